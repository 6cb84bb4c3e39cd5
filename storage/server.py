"""The storage daemon: `StorageService` (the rpc handlers) and `serve`.

All disk work runs in worker threads bounded by one `trio.CapacityLimiter`
(``io_threads``), so a cold pread or an fsync never stalls the event loop.
Reads whose record and file are cached and whose bytes are in the page cache
are served on the event loop with ``preadv2(RWF_NOWAIT)``, which fails
instead of blocking: a hot 4 KiB read then costs microseconds instead of a
thread round trip.

Writes: the client sends a write to its chain's head. This daemon checks
that the target is the head at the chain version the client used (ESTALE
otherwise: the client refreshes its routing and retries), applies the write
durably and acknowledges. With one replica per chain the head is the tail,
so applying is committing. Chain replication adds a step between the check
and the local apply (stage, forward to the successor, commit when the tail
answers); until it exists a write to a chain with more than one serving
replica is refused with EOPNOTSUPP rather than acknowledged undurably.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from shufflefs.cluster.agent import NodeAgent, unregister_node
from shufflefs.cluster.protocol import (
    MgmtdStub,
    RegisterResult,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.rpc import FsError, Reply, RpcServer, open_rpc_client, rpc_method
from shufflefs.rpc.auth import load_secret
from shufflefs.rpc.errors import as_fs_error
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.rpc.runtime import hostname, run_service, setup_logging
from shufflefs.storage.chunks import ChunkStore
from shufflefs.storage.config import StorageConfig, load_storage_config
from shufflefs.storage.layout import write_json_durably
from shufflefs.storage.protocol import ChunkInfo, ChunkPage, TargetStats, WriteResult

log = logging.getLogger("shufflefs.storage")

T = TypeVar("T")

NODE_FILE = "node.json"
USAGE_INTERVAL = 1.0  # seconds between refreshes of the capacity figures heartbeats carry


class RoutingSource(Protocol):
    """What the service needs of the routing map (a `RoutingCache`)."""

    @property
    def current(self) -> Routing: ...

    async def refresh(self, min_version: int | None = None) -> Routing: ...


class StorageService:
    """The storage rpc methods over this node's targets."""

    def __init__(
        self,
        stores: Sequence[ChunkStore],
        *,
        io_threads: int = 16,
        routing: RoutingSource | None = None,
        max_read_bytes: int = DEFAULT_LIMITS.max_payload,
    ) -> None:
        self.stores = list(stores)
        self.io_threads = max(1, io_threads)
        self.limiter = trio.CapacityLimiter(self.io_threads)
        self.routing = routing
        self.max_read_bytes = max_read_bytes
        self._by_id: dict[int, ChunkStore] = {}
        self._usage: list[tuple[ChunkStore, int, int]] = []  # (store, capacity, free)
        self.reindex()

    def reindex(self) -> None:
        """Rebuild the target id index (after mgmtd assigned ids)."""
        self._by_id = {s.target_id: s for s in self.stores if s.target_id is not None}

    def _store(self, target: int) -> ChunkStore:
        store = self._by_id.get(target)
        if store is None:
            raise FsError(errno.ENOENT, f"target {target} is not on this storage node")
        return store

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    # ---- capacity, for the heartbeats ------------------------------------

    def _measure(self) -> list[tuple[ChunkStore, int, int]]:
        return [(s, *s.capacity()) for s in self.stores]

    async def refresh_usage(self) -> None:
        self._usage = await self._io(self._measure)

    async def usage_loop(self, interval: float = USAGE_INTERVAL) -> None:
        while True:
            await trio.sleep(interval)
            try:
                await self.refresh_usage()
            except OSError as exc:
                log.warning("measuring target capacity failed: %s", exc)

    def registrations(self) -> list[TargetRegistration]:
        """This node's targets, in config order (statvfs figures from the last
        refresh: the agent calls this on the event loop)."""
        return [
            {
                "target_id": s.target_id,
                "path": str(s.path),
                "capacity": cap,
                "free": free,
                "device": s.device,
            }
            for s, cap, free in self._usage
        ]

    def usage(self) -> list[TargetUsage]:
        return [
            {
                "target_id": s.target_id,
                "capacity": cap,
                "free": free,
                "used": s.used,
                "chunks": s.chunks,
                "device": s.device,
            }
            for s, cap, free in self._usage
            if s.target_id is not None
        ]

    # ---- reads -----------------------------------------------------------

    @rpc_method
    async def read(self, items: list[tuple[int, bytes, int, int]]) -> Reply:
        """Many ranges, possibly on several targets, in one request. Per item
        the delivered length or a negative errno; one payload of all bytes."""
        total = sum(max(0, item[3]) for item in items)
        if total > self.max_read_bytes:
            raise FsError(
                errno.EMSGSIZE,
                f"read of {total} bytes exceeds the reply limit {self.max_read_bytes}: split it",
            )
        results: list[memoryview | int] = [0] * len(items)
        slow: list[int] = []
        for i, (target, chunk, offset, length) in enumerate(items):
            store = self._by_id.get(target)
            if store is None:
                results[i] = -errno.ENOENT
                continue
            try:
                data = store.read_nowait(chunk, offset, length)
            except FsError as exc:
                results[i] = -exc.code
                continue
            if data is None:
                slow.append(i)
            else:
                results[i] = data
        if slow:
            per = -(-len(slow) // self.io_threads)
            groups = [slow[k : k + per] for k in range(0, len(slow), per)]
            if len(groups) == 1:
                await self._io(self._read_items, groups[0], items, results)
            else:
                async with trio.open_nursery() as nursery:
                    for group in groups:
                        nursery.start_soon(self._io, self._read_items, group, items, results)
        lengths = [r if isinstance(r, int) else len(r) for r in results]
        return Reply({"lengths": lengths}, [r for r in results if not isinstance(r, int)])

    def _read_items(
        self,
        indices: list[int],
        items: list[tuple[int, bytes, int, int]],
        results: list[memoryview | int],
    ) -> None:
        """Worker thread: read the given items into *results* (each its own
        outcome: one bad item never fails the others)."""
        for i in indices:
            target, chunk, offset, length = items[i]
            try:
                results[i] = self._by_id[target].read(chunk, offset, length)
            except Exception as exc:
                if not isinstance(exc, OSError):
                    log.exception("read target=%d chunk=%s failed", target, chunk.hex())
                results[i] = -as_fs_error(exc).code

    # ---- writes ----------------------------------------------------------

    @rpc_method
    async def write(
        self,
        target: int,
        chain: int,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        payload: bytearray | None,
    ) -> WriteResult:
        store = self._store(target)
        await self._check_head(target, chain, chain_version)
        data = payload if payload is not None else b""
        return await self._io(store.write, chunk, offset, chunk_size, data)

    async def _check_head(self, target: int, chain: int, chain_version: int) -> None:
        """ESTALE unless *target* is the head of *chain* at *chain_version*
        (checked when the routing map knows the chain)."""
        if self.routing is None:
            return
        try:
            routing = self.routing.current
        except FsError:
            return  # not fetched yet
        info = routing.chains.get(chain)
        if info is not None and chain_version > info["version"]:
            try:  # the client has seen a newer map than ours
                routing = await self.routing.refresh()
            except FsError as exc:  # judge by ours: ESTALE below, the client retries
                log.info("routing refresh for chain=%d failed: %s", chain, exc.message)
            info = routing.chains.get(chain)
        if info is None:
            return
        if info["version"] != chain_version:
            raise FsError(
                errno.ESTALE,
                f"chain {chain} is at version {info['version']}, the write used {chain_version}",
            )
        serving = [t["id"] for t in routing.serving_targets(chain)]
        if not serving or serving[0] != target:
            raise FsError(
                errno.ESTALE,
                f"target {target} is not the head of chain {chain} (serving: {serving})",
            )
        if len(serving) > 1:
            raise FsError(
                errno.EOPNOTSUPP,
                f"chain {chain} has {len(serving)} serving replicas; this storage daemon "
                "does not forward writes along a chain yet (run with one replica per chain)",
            )

    @rpc_method
    async def truncate_file(
        self, target: int, ino: int, size: int, chunk_size: int
    ) -> dict[str, int]:
        store = self._store(target)
        changed = await self._io(store.truncate_file, ino, size, chunk_size)
        return {"changed": changed}

    @rpc_method
    async def remove_file(self, target: int, ino: int) -> dict[str, int]:
        store = self._store(target)
        return {"removed": await self._io(store.remove_file, ino)}

    # ---- inspection ------------------------------------------------------

    @rpc_method
    async def chunk_info(self, target: int, chunk: bytes) -> ChunkInfo:
        store = self._store(target)
        return await self._io(store.chunk_info, chunk)

    @rpc_method
    async def list_chunks(
        self, target: int, after: bytes | None = None, limit: int = 1000
    ) -> ChunkPage:
        store = self._store(target)
        return await self._io(store.list_chunks, after, limit)

    @rpc_method
    async def stats(self) -> dict[str, list[TargetStats]]:
        """Every registered target of this node (unregistered ones have no id)."""
        stores = list(self._by_id.values())
        return {"targets": await self._io(lambda: [s.stats() for s in stores])}


# ---- the daemon ------------------------------------------------------------


def _load_node_state(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"node_id": None, "cluster_id": None}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FsError(errno.EIO, f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict):
        raise FsError(errno.EIO, f"{path} is not a json object")
    return {"node_id": state.get("node_id"), "cluster_id": state.get("cluster_id")}


def _cluster_of(node: dict[str, Any], stores: Sequence[ChunkStore]) -> str | None:
    """The cluster this node belongs to; its targets must agree."""
    ids = {s.cluster_id for s in stores if s.cluster_id is not None}
    if node["cluster_id"] is not None:
        ids.add(node["cluster_id"])
    if len(ids) > 1:
        raise FsError(
            errno.EINVAL,
            f"this node's state and targets belong to different clusters: {sorted(ids)}",
        )
    return next(iter(ids), None)


def _listen_address(listen: str) -> tuple[str, int]:
    """'host:port' to listen on; unlike a peer's address, port 0 (any free
    port) and an empty host (every interface) are allowed."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise FsError(errno.EINVAL, f"bad listen address {listen!r}: expected host:port")
    return host.strip("[]"), int(port)


def _advertised(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = hostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < wanted:
        log.warning("open file limit %d is below the %d the fd caches may use", new, wanted)


def _open_store(config: StorageConfig, path: str) -> ChunkStore:
    return ChunkStore(
        path,
        block_size=config.block_size,
        fsync=config.fsync,
        reserve_bytes=config.reserve_bytes,
        fd_cache=config.fd_cache,
        max_readers=max(126, 4 * config.io_threads + 32),
    )


async def serve(
    config: StorageConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a storage daemon until cancelled: open (formatting new) targets,
    serve rpc, register with mgmtd and heartbeat, unregister on a clean stop.
    Reports the bound port through *task_status* once registered."""
    config.validate()
    secret = load_secret(Path(config.secret_file))
    data_dir = Path(config.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    node_file = data_dir / NODE_FILE
    node = _load_node_state(node_file)
    _raise_fd_limit(config.fd_cache * len(config.targets) + 1024)
    stores: list[ChunkStore] = []
    registered: int | None = None  # our node id once mgmtd accepted us this run
    try:
        for path in config.targets:
            stores.append(await trio.to_thread.run_sync(_open_store, config, path))
        cluster_id = _cluster_of(node, stores)
        service = StorageService(stores, io_threads=config.io_threads)
        await service.refresh_usage()
        server = RpcServer(secret, [service], name="storage")
        host, port = _listen_address(config.listen)

        def on_registered(result: RegisterResult) -> None:
            state = {"node_id": result["node_id"], "cluster_id": result["cluster_id"]}
            if state != node:
                write_json_durably(node_file, state, config.fsync)
                node.update(state)
            if len(result["target_ids"]) != len(stores):
                raise FsError(
                    errno.EPROTO,
                    f"mgmtd assigned {len(result['target_ids'])} target ids for {len(stores)}",
                )
            for store, target_id in zip(stores, result["target_ids"], strict=True):
                store.set_identity(target_id, result["cluster_id"])
            service.reindex()

        async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, host, port)
            address = config.advertise or _advertised(host, port)
            routing = RoutingCache(rpc, config.mgmtd)

            async def on_routing_version(version: int) -> None:
                await routing.refresh(version)

            agent = NodeAgent(
                MgmtdStub(rpc, config.mgmtd),
                kind="storage",
                address=address,
                host=config.host or hostname(),
                cluster_id=cluster_id,
                node_id=node["node_id"],
                targets=service.registrations,
                usage=service.usage,
                on_registered=on_registered,
                on_routing_version=on_routing_version,
            )
            await nursery.start(agent.run)
            registered = agent.node_id
            await routing.start(nursery)
            service.routing = routing
            nursery.start_soon(service.usage_loop)
            log.info(
                "storage node=%s serving address=%s targets=%s",
                agent.node_id,
                address,
                ",".join(s.label for s in stores),
            )
            task_status.started(port)
            await trio.sleep_forever()
    finally:
        if registered is not None:
            with trio.CancelScope(shield=True):
                await unregister_node(secret, config.mgmtd, registered)
        for store in stores:
            store.close()


def main(config_path: str) -> int:
    """Run the storage daemon described by a TOML file; returns an exit code."""
    config = load_storage_config(config_path)
    setup_logging("storage", config.log_file, config.log_level)
    return run_service("storage", functools.partial(serve, config))


def cli_main(args: argparse.Namespace) -> int:
    """``shufflefs storage --config FILE``."""
    return main(args.config)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
