"""The storage daemon: `StorageDaemon` (one node's bootstrap and lifetime),
`serve`, and the ``shufflefs storage --config FILE`` entry point.

Bootstrap is the one every server uses (`shufflefs.cluster.node`): the
node's identity in ``node.json`` (with the targets added at runtime), the
address to listen on and the address to register. The config was checked
when it was loaded (`StorageConfig.validate`).
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import resource
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from shufflefs.cluster.agent import NodeAgent, unregister_node
from shufflefs.cluster.metrics import start_metrics
from shufflefs.cluster.metrics_collectors import storage_gauges
from shufflefs.cluster.node import NodeState, advertised_address, listen_address
from shufflefs.cluster.protocol import MgmtdStub, RegisterResult
from shufflefs.cluster.routing import RoutingCache
from shufflefs.rpc import FsError, RpcServer, open_rpc_client
from shufflefs.rpc.addresses import hostname
from shufflefs.rpc.cluster_secret import load_secret
from shufflefs.rpc.runtime import run_service, setup_logging
from shufflefs.storage.cache import fd_share
from shufflefs.storage.config import StorageConfig, load_storage_config
from shufflefs.storage.forwarding import REPORT_TIMEOUT
from shufflefs.storage.service import StorageService
from shufflefs.storage.store import ChunkStore

log = logging.getLogger("shufflefs.storage")


def _cluster_of(node: NodeState, stores: Sequence[ChunkStore]) -> str | None:
    """The cluster this node belongs to; its targets must agree."""
    ids = {s.cluster_id for s in stores if s.cluster_id is not None}
    if node.cluster_id is not None:
        ids.add(node.cluster_id)
    if len(ids) > 1:
        raise FsError(
            errno.EINVAL,
            f"this node's state and targets belong to different clusters: {sorted(ids)}",
        )
    return next(iter(ids), None)


FDS_KEPT = 0.25  # of the open-file limit, left to all but the fd caches (sockets, logs, ...)
FDS_KEPT_AT_LEAST = 4096


def fd_cache_share(config: StorageConfig, targets: int) -> int:
    """Open chunk files each target's fd cache keeps: the config's
    `fd_cache`, or less where the open-file limit (raised first) is lower.
    A target added while the daemon runs gets the same share, out of the
    part kept for the rest."""
    share = fd_share(config.fd_cache, targets, kept=FDS_KEPT, at_least=FDS_KEPT_AT_LEAST)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    log.log(
        logging.WARNING if share < config.fd_cache else logging.INFO,
        "fd caches: up to %d chunk files open per target (fd_cache=%d, %d targets, "
        "open-file limit %d%s)",
        share,
        config.fd_cache,
        targets,
        limit,
        "; raise LimitNOFILE for more" if share < config.fd_cache else "",
    )
    return share


def open_store(config: StorageConfig, fd_cache: int, path: str) -> ChunkStore:
    """Open (formatting it if new) the target at *path* with the config's
    settings, keeping up to *fd_cache* of its chunk files open."""
    return ChunkStore(
        path,
        block_size=config.block_size,
        fsync=config.fsync,
        reserve_bytes=config.reserve_bytes,
        fd_cache=fd_cache,
        max_readers=max(126, 4 * config.io_threads + 32),
    )


class StorageDaemon:
    """One storage node: its targets, the rpc server, registration and
    heartbeats, the routing map and the background work. `serve` runs one;
    tests run several in one process and reach into them."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.service: StorageService | None = None
        self.server: RpcServer | None = None
        self.routing: RoutingCache | None = None
        self.node_id: int | None = None
        self.port: int | None = None
        self.address: str | None = None
        # a clean stop tells mgmtd at once; False stops like a crashed process
        self.unregister_on_stop = True
        self.cancel_scope: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled: open (formatting new) targets, serve rpc,
        register with mgmtd and heartbeat, unregister on a clean stop.
        Reports the bound port through *task_status* once registered."""
        config = self.config
        secret = load_secret(Path(config.secret_file))
        data_dir = Path(config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        node = NodeState.load(data_dir)
        configured = {os.path.realpath(t) for t in config.targets}
        paths = list(config.targets) + [
            p for p in node.targets if os.path.realpath(p) not in configured
        ]
        opener = functools.partial(open_store, config, fd_cache_share(config, len(paths)))
        stores: list[ChunkStore] = []
        service: StorageService | None = None
        registered: int | None = None  # our node id once mgmtd accepted us this run
        try:
            for path in paths:
                stores.append(await trio.to_thread.run_sync(opener, path))
            cluster_id = _cluster_of(node, stores)
            service = StorageService(
                stores,
                io_threads=config.io_threads,
                forward_timeout=config.forward_timeout,
                scrub_interval=config.scrub_interval,
                open_target=opener,
            )
            self.service = service
            await service.capacity.refresh()
            server = self.server = RpcServer(
                secret, [service], name="storage", channel_threads=config.io_threads
            )
            host, port = listen_address(config.listen)

            def on_registered(result: RegisterResult) -> None:
                assert service is not None
                if (result["node_id"], result["cluster_id"]) != (node.node_id, node.cluster_id):
                    node.node_id, node.cluster_id = result["node_id"], result["cluster_id"]
                    node.save(data_dir, fsync=config.fsync)
                # the registration listed our stores in order; a target added
                # meanwhile (appended) is registered by the next registration
                current = list(service.node.stores)
                ids = result["target_ids"]
                if len(ids) > len(current):
                    raise FsError(
                        errno.EPROTO, f"mgmtd assigned {len(ids)} target ids for {len(current)}"
                    )
                for store, target_id in zip(current, ids, strict=False):
                    store.set_identity(target_id, result["cluster_id"])
                service.node.reindex()

            async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
                self.cancel_scope = nursery.cancel_scope
                routing = RoutingCache(rpc, config.mgmtd)
                self.routing = routing
                mgmtd = MgmtdStub(rpc, config.mgmtd)
                # before the first request can arrive: without a routing map a
                # write would apply here alone, unreplicated (with one that is
                # not fetched yet, it is refused with ESTALE)
                links = service.node
                links.routing, links.rpc, links.mgmtd = routing, rpc, mgmtd
                routing.listeners.append(service.forwarding.routing_changed)
                port = await nursery.start(server.serve, host, port)
                self.port = port
                address = advertised_address(host, port, advertise=config.advertise)
                self.address = address

                async def on_routing_version(version: int) -> None:
                    await routing.refresh(version)

                agent = NodeAgent(
                    mgmtd,
                    kind="storage",
                    address=address,
                    host=config.host or hostname(),
                    cluster_id=cluster_id,
                    node_id=node.node_id,
                    targets=service.capacity.registrations,
                    usage=service.capacity.usage,
                    on_registered=on_registered,
                    on_routing_version=on_routing_version,
                )

                async def targets_changed() -> None:
                    """A target was added: remember it, then register again so
                    mgmtd gives it an id (bounded: mgmtd may be down)."""
                    assert service is not None
                    node.targets = [
                        str(s.path)
                        for s in service.node.stores
                        if os.path.realpath(s.path) not in configured
                    ]
                    node.save(data_dir, fsync=config.fsync)
                    with trio.fail_after(REPORT_TIMEOUT * 2):
                        await agent.register()

                await nursery.start(agent.run)
                registered = self.node_id = agent.node_id
                await routing.start(nursery)
                links.node_id = agent.node_id
                service.on_targets_changed = targets_changed
                nursery.start_soon(service.capacity.run)
                await nursery.start(service.run_background)
                await start_metrics(
                    nursery,
                    config.metrics,
                    kind="storage",
                    rpc=rpc,
                    mgmtd=config.mgmtd,
                    node_id=lambda: agent.node_id,
                    collectors=[storage_gauges(service)],
                )
                log.info(
                    "storage node=%s serving address=%s targets=%s",
                    agent.node_id,
                    address,
                    ",".join(s.label for s in stores),
                )
                task_status.started(port)
                await trio.sleep_forever()
        finally:
            if registered is not None and self.unregister_on_stop:
                with trio.CancelScope(shield=True):
                    await unregister_node(secret, config.mgmtd, registered)
            for store in service.node.stores if service is not None else stores:
                store.close()

    def stop(self, *, clean: bool = True) -> None:
        """Stop serving; with ``clean=False`` mgmtd is not told (as if the
        process died), so it notices only by a missed heartbeat or a peer's
        report."""
        self.unregister_on_stop = clean
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()


async def serve(
    config: StorageConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a storage daemon until cancelled (see `StorageDaemon.run`)."""
    await StorageDaemon(config).run(task_status=task_status)


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
