"""The storage daemon: `StorageService` (the rpc handlers) and `serve`.

All disk work runs in worker threads bounded by one `trio.CapacityLimiter`
(``io_threads``), so a cold pread or an fsync never stalls the event loop.
Reads whose record and file are cached and whose bytes are in the page cache
are served on the event loop with ``preadv2(RWF_NOWAIT)``, which fails
instead of blocking: a hot 4 KiB read then costs microseconds instead of a
thread round trip.

Writes follow chain replication (CRAQ style, docs/storage.md): the head of a
chain stages the new chunk version, forwards it to its successor, which
stages and forwards in turn; the tail commits first, each replica commits
once its successor acknowledged, and the head commits last and only then
answers the client. An acknowledged write is therefore durable on every
serving and syncing replica, and a read (which sees committed records only)
never returns an update that could still be undone. Updates of one chunk are
serialized from stage to commit by a per-chunk lock; truncations and removals
of a file take the file's lock exclusively, so on every replica they are
ordered the same way against the writes.

Background work: a syncing target is brought up to date from a serving
replica (`resync`), a chunk found damaged is copied again from a healthy
replica (`repair`), and `scrub` verifies and repairs on demand or
periodically.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from shufflefs.cluster.agent import NodeAgent, unregister_node
from shufflefs.cluster.protocol import (
    ChainInfo,
    MgmtdStub,
    RegisterResult,
    TargetInfo,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.rpc import FsError, Reply, RpcClient, RpcServer, open_rpc_client, rpc_method
from shufflefs.rpc.auth import load_secret
from shufflefs.rpc.errors import CONNECTION_FAILURES, as_fs_error
from shufflefs.rpc.files import write_json_durably
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.rpc.runtime import hostname, run_service, setup_logging
from shufflefs.storage.cache import raise_fd_limit
from shufflefs.storage.chain import (
    LockTable,
    Place,
    ResyncStats,
    SyncState,
    chain_of,
    same_info,
    same_record,
)
from shufflefs.storage.chunks import ChunkStore, Staged
from shufflefs.storage.config import StorageConfig, load_storage_config
from shufflefs.storage.layout import (
    check_chunk_id,
    check_chunk_size,
)
from shufflefs.storage.protocol import (
    NEED_FULL,
    ChunkInfo,
    ChunkMeta,
    ChunkPage,
    ScrubResult,
    StorageStub,
    TargetStats,
    WriteResult,
)

log = logging.getLogger("shufflefs.storage")

T = TypeVar("T")

NODE_FILE = "node.json"
USAGE_INTERVAL = 1.0  # seconds between refreshes of the capacity figures heartbeats carry
FORWARD_TIMEOUT = 10.0  # per replica still ahead: the head of a 3-chain waits 20 s, its middle 10 s
COPY_TIMEOUT = 60.0  # read_chunk / list_chunks calls of resync, repair and scrub
REPORT_TIMEOUT = 8.0  # telling mgmtd a successor is unreachable, and refreshing routing after
RESYNC_PAGE = 512  # chunks per list_chunks page while resyncing
RESYNC_RETRIES = 8  # copies of one chunk that keep racing with the chain before a resync pass fails
RESYNC_POLL = 0.25  # seconds between looks at the routing map for targets to resync
REPAIR_QUEUE = 4096  # chunks waiting for repair; beyond that, damage is only logged
# A chunk no replica could repair is not queued again for this long: when every
# copy is damaged, each repair attempt reads the other copies, finds them
# damaged too and would queue their repairs, round and round. (scrub always tries.)
REPAIR_COOLDOWN = 300.0
SCRUB_MAX = 1024  # chunks per scrub call
SCRUB_PAGE = 64  # chunks per page of the periodic scrub

# Failures of a call to a successor that mean "it is not there" (as opposed
# to an answer from it). A replica never relays these upstream: it turns an
# unreachable successor of its own into ESTALE.
UNREACHABLE = CONNECTION_FAILURES


class RoutingSource(Protocol):
    """What the service needs of the routing map (a `RoutingCache`)."""

    @property
    def current(self) -> Routing: ...

    async def refresh(self, min_version: int | None = None) -> Routing: ...


class _ChainChanged(Exception):
    """The chain changed under a resync pass: start it over."""


@dataclass
class _ScrubCounts:
    checked: int = 0
    corrupt: int = 0
    divergent: int = 0
    repaired: int = 0
    unrecoverable: int = 0
    handled: set[bytes] = field(default_factory=set)


# ---- the service -------------------------------------------------------------------


class StorageService:
    """The storage rpc methods over this node's targets.

    *rpc*, *mgmtd* and *node_id* are what chain replication needs (forward
    to successors, report dead ones, resync, repair); without them (unit
    tests of a lone target) writes apply locally. *open_target* and
    *on_targets_changed* let `add_target` create targets at runtime."""

    def __init__(
        self,
        stores: Sequence[ChunkStore],
        *,
        io_threads: int = 16,
        routing: RoutingSource | None = None,
        max_read_bytes: int = DEFAULT_LIMITS.max_payload,
        rpc: RpcClient | None = None,
        mgmtd: MgmtdStub | None = None,
        node_id: int | None = None,
        forward_timeout: float = FORWARD_TIMEOUT,
        scrub_interval: float = 0.0,
        open_target: Callable[[str], ChunkStore] | None = None,
        on_targets_changed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.stores = list(stores)
        self.io_threads = max(1, io_threads)
        self.limiter = trio.CapacityLimiter(self.io_threads)
        self.routing = routing
        self.forwards: set[tuple[int, int, trio.CancelScope]] = set()  # see _call_successor
        self.max_read_bytes = max_read_bytes
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.node_id = node_id
        self.forward_timeout = forward_timeout
        self.scrub_interval = scrub_interval
        self.open_target = open_target
        self.on_targets_changed = on_targets_changed
        self.locks = LockTable()
        self._by_id: dict[int, ChunkStore] = {}
        self._usage: dict[str, tuple[int, int]] = {}  # store path -> (capacity, free)
        self._add_lock = trio.Lock()
        self._sync: dict[int, SyncState] = {}
        self._resyncing: set[int] = set()
        self.resyncs: list[ResyncStats] = []  # finished resync passes, newest last
        self._repair_send: trio.MemorySendChannel[tuple[int, bytes]] | None = None
        self._repair_pending: set[tuple[int, bytes]] = set()
        # chunks no replica could repair -> when (trio clock) that was found
        self._repair_failed: dict[tuple[int, bytes], float] = {}
        self.full_resends = 0  # deltas a successor refused (NEED_FULL) and got whole
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

    def _measure(self) -> dict[str, tuple[int, int]]:
        return {str(s.path): s.capacity() for s in list(self.stores)}

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
        """This node's targets, in the order of `stores` (statvfs figures from
        the last refresh: the agent calls this on the event loop)."""
        out: list[TargetRegistration] = []
        for s in self.stores:
            cap, free = self._usage.get(str(s.path), (0, 0))
            out.append(
                {
                    "target_id": s.target_id,
                    "path": str(s.path),
                    "capacity": cap,
                    "free": free,
                    "device": s.device,
                }
            )
        return out

    def usage(self) -> list[TargetUsage]:
        out: list[TargetUsage] = []
        for s in self.stores:
            if s.target_id is None:
                continue
            cap, free = self._usage.get(str(s.path), (0, 0))
            out.append(
                {
                    "target_id": s.target_id,
                    "capacity": cap,
                    "free": free,
                    "used": s.used,
                    "chunks": s.chunks,
                    "device": s.device,
                }
            )
        return out

    # ---- reads -----------------------------------------------------------

    def read_fast(self, items: list[tuple[int, bytes, int, int]]) -> Reply | None:
        """`read` inline in the connection's reader task when every item is in
        the page cache (no thread, no task); None to run `read` itself."""
        total = sum(max(0, item[3]) for item in items)
        if total > self.max_read_bytes:
            return None
        data: list[memoryview] = []
        lengths: list[int] = []
        for target, chunk, offset, length in items:
            store = self._by_id.get(target)
            if store is None:
                return None
            try:
                got = store.read_nowait(chunk, offset, length)
            except FsError:
                return None
            if got is None:
                return None
            lengths.append(len(got))
            if len(got):
                data.append(got)
        return Reply({"lengths": lengths}, data)

    @rpc_method(fast="read_fast")
    async def read(self, items: list[tuple[int, bytes, int, int]]) -> Reply:
        """Many ranges, possibly on several targets, in one request. Per item
        the delivered length or a negative errno; one payload of all bytes.
        Only committed data is ever returned. A damaged chunk fails its item
        with EIO (the client reads another replica) and is queued for repair."""
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
        for i in slow:
            if results[i] == -errno.EIO:
                self.schedule_repair(items[i][0], items[i][1])
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

    @rpc_method
    async def read_chunk(self, target: int, chunk: bytes) -> Reply:
        """A whole committed chunk with its version, every block verified (for
        resync, repair and scrub on another replica). Taken under the chunk's
        lock: an update in flight here finishes first, so what is returned
        includes every update that reached the replicas after this one."""
        store = self._store(target)
        check_chunk_id(chunk)
        async with self.locks.update(target, chunk):
            try:
                rec, data = await self._io(store.read_full, chunk)
            except FsError as exc:
                if exc.code == errno.EIO:
                    self.schedule_repair(target, chunk)
                raise
        meta: ChunkMeta = {
            "version": rec.version,
            "length": rec.length,
            "chunk_size": rec.chunk_size,
        }
        return Reply(meta, data)

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
        """A client's write, at the chain's head: stage, forward along the
        chain, commit after the successor acknowledged."""
        store = self._store(target)
        check_chunk_id(chunk)
        data = payload if payload is not None else b""
        async with self.locks.update(target, chunk):
            place = await self._place(target, chain, chain_version, head=True)
            if place is not None:
                self._check_min_replicas(place)
            try:
                staged = await self._io(store.stage_write, chunk, offset, data, chunk_size, None)
            except FsError as exc:
                if exc.code == errno.EIO and self._other_serving(target):
                    self.schedule_repair(target, chunk)
                    raise FsError(
                        errno.EAGAIN,
                        f"{exc.message}; the chunk is being repaired from another replica, retry",
                    ) from None
                raise
            return await self._forward_then_commit(
                store, staged, place, chain_version, chunk, offset, chunk_size, data, False
            )

    @rpc_method
    async def replicate(
        self,
        target: int,
        chain: int,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        version: int,
        base_version: int,
        full: bool,
        payload: bytearray | None,
    ) -> WriteResult:
        """An update forwarded by this target's predecessor in the chain:
        stage it, forward it to our successor, commit after its ack. A delta
        applies only on *base_version* (else `NEED_FULL`); ``full`` carries
        the whole new chunk."""
        store = self._store(target)
        check_chunk_id(chunk)
        data = payload if payload is not None else b""
        if not full and version != base_version + 1:
            raise FsError(
                errno.EINVAL, f"version {version} does not follow base_version {base_version}"
            )
        async with self.locks.update(target, chunk):
            place = await self._place(target, chain, chain_version, head=False)
            sync = self._sync_of(target, place)
            if full:
                staged = await self._io(store.stage_replace, chunk, data, chunk_size, version)
            else:
                try:
                    staged = await self._io(
                        store.stage_write, chunk, offset, data, chunk_size, version
                    )
                except FsError as exc:
                    if exc.code != errno.EIO:
                        raise
                    raise FsError(  # the whole chunk heals the damaged block
                        NEED_FULL, f"{exc.message}: send the whole chunk"
                    ) from None
            result = await self._forward_then_commit(
                store, staged, place, chain_version, chunk, offset, chunk_size, data, full
            )
            if sync is not None:
                # whole, new (it applied on version 0: we had none either), or
                # built on a verified chunk: equal to the chain's copy. A delta
                # on an unverified one may sit on stale bytes (a chunk removed
                # and written again restarts at version 1): resync still
                # compares and copies it.
                sync.touch(chunk)
                if full or base_version == 0 or chunk in sync.trusted:
                    sync.trusted.add(chunk)
                sync.forwarded += 1
            return result

    async def _forward_then_commit(
        self,
        store: ChunkStore,
        staged: Staged,
        place: Place | None,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        data: bytes | bytearray,
        full: bool,
    ) -> WriteResult:
        """The rest of an update once staged here: forward it (if this target
        has a successor), then commit; on any failure abort, so nothing is
        committed here that the rest of the chain did not acknowledge."""
        try:
            if place is not None and place.successor is not None and staged.new is not None:
                await self._forward(
                    store, staged, place, chain_version, chunk, offset, chunk_size, data, full
                )
            return await self._io(store.commit, staged)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._io(store.abort, staged)
            raise

    async def _forward(
        self,
        store: ChunkStore,
        staged: Staged,
        place: Place,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        data: bytes | bytearray,
        full: bool,
    ) -> None:
        succ = place.successor
        assert succ is not None

        async def send(stub: StorageStub) -> None:
            try:
                await stub.replicate(
                    succ["id"],
                    place.chain,
                    chain_version,
                    chunk,
                    0 if full else offset,
                    chunk_size,
                    staged.version,
                    staged.base_version,
                    full,
                    data,
                )
            except FsError as exc:
                if exc.code != NEED_FULL or full:
                    raise
                content = await self._io(store.staged_content, staged)
                self.full_resends += 1
                log.info(
                    "replica needs the whole chunk target=%d chunk=%s version=%d bytes=%d: %s",
                    succ["id"],
                    chunk.hex(),
                    staged.version,
                    len(content),
                    exc.message,
                )
                await stub.replicate(
                    succ["id"],
                    place.chain,
                    chain_version,
                    chunk,
                    0,
                    chunk_size,
                    staged.version,
                    staged.base_version,
                    True,
                    content,
                )

        await self._call_successor(place, send)

    async def _call_successor(
        self, place: Place, call: Callable[[StorageStub], Awaitable[None]]
    ) -> None:
        """Run *call* against our successor. If it cannot be reached, report it
        to mgmtd (which checks for itself and takes it out of the chain),
        refresh our routing and answer ESTALE: the client retries once the
        chain changed. Its answers (ENOSPC, EIO, ESTALE...) pass through."""
        succ = place.successor
        assert succ is not None
        if self.rpc is None:
            raise FsError(errno.EIO, "this storage service has no rpc client to forward with")
        try:
            address = place.routing.target_address(succ["id"])
        except FsError as exc:
            raise FsError(errno.ESTALE, exc.message) from None
        stub = StorageStub(self.rpc, address, timeout=self.forward_timeout * place.remaining)
        # If mgmtd changes the chain meanwhile (it took a silent successor out
        # after the heartbeat timeout), stop waiting for the timeout: the
        # client retries on the new chain at once.
        watch = (place.chain, place.version, trio.CancelScope())
        self.forwards.add(watch)
        try:
            with watch[2]:
                await call(stub)
        except FsError as exc:
            if exc.code not in UNREACHABLE:
                raise
            await self._successor_unreachable(place, succ, address, exc)
            raise FsError(
                errno.ESTALE,
                f"replica target {succ['id']} on node {succ['node']} of chain {place.chain} is "
                f"unreachable ({exc.message}); reported to mgmtd: retry once the chain changed",
            ) from None
        finally:
            self.forwards.discard(watch)
        if watch[2].cancelled_caught:
            raise FsError(
                errno.ESTALE,
                f"chain {place.chain} changed while forwarding to target {succ['id']}: retry",
            )

    def routing_changed(self, routing: Routing) -> None:
        """Cancel forwards to chains that changed (a `RoutingCache` listener)."""
        for chain, version, scope in list(self.forwards):
            info = routing.chains.get(chain)
            if info is None or info["version"] != version:
                scope.cancel()

    async def _successor_unreachable(
        self, place: Place, succ: TargetInfo, address: str, exc: FsError
    ) -> None:
        log.warning(
            "successor unreachable chain=%d target=%d node=%d address=%s: %s",
            place.chain,
            succ["id"],
            succ["node"],
            address,
            exc.message,
        )
        if self.rpc is not None:
            self.rpc.drop(address)
        # bounded by our own forward timeout too: our predecessor waits for us
        # only a forward timeout longer than we waited for our successor
        with trio.move_on_after(min(REPORT_TIMEOUT, self.forward_timeout)):
            if self.mgmtd is not None and self.node_id is not None:
                try:
                    marked = await self.mgmtd.report_unreachable(self.node_id, succ["node"])
                    log.info(
                        "reported node=%d unreachable; marked offline=%s", succ["node"], marked
                    )
                except FsError as report_exc:
                    log.warning(
                        "reporting node=%d unreachable failed: %s", succ["node"], report_exc.message
                    )
            if self.routing is not None:
                with contextlib.suppress(FsError):
                    await self.routing.refresh()

    async def _place(
        self, target: int, chain: int, chain_version: int, *, head: bool
    ) -> Place | None:
        """Where *target* stands in *chain* at *chain_version*: ESTALE if the
        chain is at another version, or the target is not the head (for a
        client's call, *head*) or not a later replica (for a forwarded one).
        A caller with a newer version than ours makes us refresh first.
        None when this service has no routing map at all (a lone target)."""
        if self.routing is None:
            return None
        try:
            routing = self.routing.current
            info = routing.chains.get(chain)
            stale = info is None or chain_version > info["version"]
        except FsError:
            stale = True
        if stale:
            try:
                await self.routing.refresh()
            except FsError as exc:  # judge by ours: ESTALE below, the caller retries
                log.info("routing refresh for chain=%d failed: %s", chain, exc.message)
        try:
            routing = self.routing.current
        except FsError as exc:
            raise FsError(errno.ESTALE, f"no routing map yet: {exc.message}") from None
        info = routing.chains.get(chain)
        if info is None:
            raise FsError(errno.ESTALE, f"chain {chain} is unknown to this storage node")
        if info["version"] != chain_version:
            raise FsError(
                errno.ESTALE,
                f"chain {chain} is at version {info['version']}, the call used {chain_version}",
            )
        members = routing.write_targets(chain)
        ids = [t["id"] for t in members]
        if target not in ids:
            raise FsError(
                errno.ESTALE, f"target {target} takes no writes in chain {chain} (members: {ids})"
            )
        index = ids.index(target)
        if head and index != 0:
            raise FsError(
                errno.ESTALE, f"target {target} is not the head of chain {chain} (members: {ids})"
            )
        if not head and index == 0:
            raise FsError(
                errno.ESTALE, f"target {target} is the head of chain {chain}, not a replica"
            )
        return Place(routing, chain, chain_version, members, index)

    @staticmethod
    def _check_min_replicas(place: Place) -> None:
        serving = place.routing.serving_targets(place.chain)
        minimum = place.routing.config.get("min_replicas", 1)
        if len(serving) < minimum:
            raise FsError(
                errno.EROFS,
                f"chain {place.chain} has {len(serving)} serving replica(s), fewer than "
                f"min_replicas={minimum}: writes are refused until a replica is back",
            )

    # ---- truncate and remove, along the chain ----------------------------------

    @rpc_method
    async def truncate_file(
        self, target: int, chain: int, chain_version: int, ino: int, size: int, chunk_size: int
    ) -> dict[str, int]:
        """Cut file *ino* on *chain* to *size*, on every replica (at the head)."""
        changed = await self._file_op(target, chain, chain_version, ino, size, chunk_size, True)
        return {"changed": changed}

    @rpc_method
    async def remove_file(
        self, target: int, chain: int, chain_version: int, ino: int
    ) -> dict[str, int]:
        """Remove file *ino*'s chunks on *chain*, on every replica (at the head)."""
        return {"removed": await self._file_op(target, chain, chain_version, ino, None, 0, True)}

    @rpc_method
    async def replicate_truncate(
        self, target: int, chain: int, chain_version: int, ino: int, size: int, chunk_size: int
    ) -> dict[str, int]:
        """`truncate_file` forwarded by our predecessor."""
        changed = await self._file_op(target, chain, chain_version, ino, size, chunk_size, False)
        return {"changed": changed}

    @rpc_method
    async def replicate_remove(
        self, target: int, chain: int, chain_version: int, ino: int
    ) -> dict[str, int]:
        """`remove_file` forwarded by our predecessor."""
        return {"removed": await self._file_op(target, chain, chain_version, ino, None, 0, False)}

    async def _file_op(
        self,
        target: int,
        chain: int,
        chain_version: int,
        ino: int,
        size: int | None,
        chunk_size: int,
        head: bool,
    ) -> int:
        """Truncate (*size* given) or remove a file's chunks here and down the
        chain, holding the file's lock exclusively: the successor first, this
        replica after its ack (like a write). Every call is idempotent."""
        store = self._store(target)
        if not 0 <= ino < 1 << 64:
            raise FsError(errno.EINVAL, f"inode {ino} out of range")
        if size is not None:
            check_chunk_size(chunk_size)
            if size < 0:
                raise FsError(errno.EINVAL, f"negative size {size}")
        async with self.locks.whole_file(target, ino):
            place = await self._place(target, chain, chain_version, head=head)
            if place is not None and place.successor is not None:
                succ = place.successor

                async def send(stub: StorageStub) -> None:
                    if size is None:
                        await stub.replicate_remove(succ["id"], chain, chain_version, ino)
                    else:
                        await stub.replicate_truncate(
                            succ["id"], chain, chain_version, ino, size, chunk_size
                        )

                await self._call_successor(place, send)
            if size is None:
                n = await self._io(store.remove_file, ino)
            else:
                n = await self._io(store.truncate_file, ino, size, chunk_size)
            sync = self._sync_of(target, place)
            if sync is not None:
                sync.touch_file(ino)
                sync.forwarded += 1
        return n

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

    # ---- copying chunks between replicas ------------------------------------------

    def _routing_now(self) -> Routing | None:
        if self.routing is None:
            return None
        try:
            return self.routing.current
        except FsError:
            return None

    def _other_serving(self, target: int) -> list[TargetInfo]:
        """The serving replicas of *target*'s chain other than it, head first."""
        routing = self._routing_now()
        chain = chain_of(routing, target) if routing is not None else None
        if routing is None or chain is None:
            return []
        return [t for t in routing.serving_targets(chain["id"]) if t["id"] != target]

    async def _fetch(self, source: TargetInfo, cid: bytes) -> tuple[ChunkMeta, bytearray]:
        routing = self._routing_now()
        if routing is None or self.rpc is None:
            raise FsError(errno.EHOSTDOWN, "no routing map or rpc client to reach other replicas")
        stub = StorageStub(self.rpc, routing.target_address(source["id"]), timeout=COPY_TIMEOUT)
        return await stub.read_chunk(source["id"], cid)

    async def _install(
        self, store: ChunkStore, cid: bytes, data: bytes | bytearray, chunk_size: int, version: int
    ) -> None:
        """Replace our copy of a chunk with another replica's (the caller holds
        the chunk's lock)."""

        def install() -> None:
            staged = store.stage_replace(cid, data, chunk_size, version)
            store.commit(staged)

        await self._io(install)
        sync = self._sync.get(store.target_id or 0)
        if sync is not None:
            sync.touch(cid)

    def schedule_repair(self, target: int, cid: bytes) -> None:
        """Queue a damaged chunk for repair from a healthy replica (once)."""
        key = (target, cid)
        if key in self._repair_pending:
            return
        failed = self._repair_failed.get(key)
        if failed is not None and trio.current_time() - failed < REPAIR_COOLDOWN:
            return
        if self._repair_send is None:
            log.debug("no repair worker: target=%d chunk=%s stays damaged", target, cid.hex())
            return
        try:
            self._repair_send.send_nowait(key)
        except trio.WouldBlock:
            log.warning("repair queue full: target=%d chunk=%s not queued", target, cid.hex())
            return
        self._repair_pending.add(key)

    async def _repair_worker(self, receive: trio.MemoryReceiveChannel[tuple[int, bytes]]) -> None:
        async for target, cid in receive:
            healthy = False
            try:
                healthy = await self.repair(target, cid)
            except FsError as exc:
                log.warning("repair target=%d chunk=%s failed: %s", target, cid.hex(), exc.message)
            except Exception:  # a bug: logged, the worker goes on
                log.exception("repair target=%d chunk=%s failed unexpectedly", target, cid.hex())
            finally:
                self._repair_pending.discard((target, cid))
            if healthy:
                self._repair_failed.pop((target, cid), None)
            else:
                now = trio.current_time()
                self._repair_failed[(target, cid)] = now
                for key, when in list(self._repair_failed.items()):  # keep it small
                    if now - when >= REPAIR_COOLDOWN:
                        del self._repair_failed[key]

    async def repair(self, target: int, cid: bytes) -> bool:
        """Replace a damaged chunk of *target* with a healthy replica's copy, at
        that replica's version. True if the chunk is healthy afterwards (or
        gone); False if no other serving replica had a healthy copy
        (logged as unrecoverable)."""
        store = self._store(target)
        for _ in range(3):
            rec0 = await self._io(store.committed, cid)
            if rec0 is None:
                return True
            sources = self._other_serving(target)
            fetched: tuple[TargetInfo, ChunkMeta, bytearray] | None = None
            for source in sources:
                try:
                    meta, data = await self._fetch(source, cid)
                except FsError as exc:
                    log.info(
                        "repair target=%d chunk=%s: no copy from target=%d: %s",
                        target,
                        cid.hex(),
                        source["id"],
                        exc.message,
                    )
                    continue
                if meta["version"] < rec0.version:
                    log.info(
                        "repair target=%d chunk=%s: target=%d is behind (version %d < %d)",
                        target,
                        cid.hex(),
                        source["id"],
                        meta["version"],
                        rec0.version,
                    )
                    continue
                fetched = (source, meta, data)
                break
            if fetched is None:
                log.error(
                    "unrecoverable damage target=%d chunk=%s version=%d: no other serving "
                    "replica has a healthy copy (tried %s)",
                    target,
                    cid.hex(),
                    rec0.version,
                    [s["id"] for s in sources],
                )
                return False
            source, meta, data = fetched
            async with self.locks.update(target, cid):
                rec = await self._io(store.committed, cid)
                if not same_record(rec, rec0):
                    continue  # rewritten meanwhile: look again
                if await self._io(store.verify, cid) is None:
                    return True
                await self._install(store, cid, data, meta["chunk_size"], meta["version"])
            log.warning(
                "repaired target=%d chunk=%s from target=%d version=%d bytes=%d",
                target,
                cid.hex(),
                source["id"],
                meta["version"],
                len(data),
            )
            return True
        return await self._io(store.verify, cid) is None

    async def _reconcile(self, target: int, source: TargetInfo, cid: bytes) -> bool | None:
        """Make our copy of *cid* equal to *source*'s (the chain's head): the
        source's copy is read under its chunk lock, ours replaced under ours
        if it did not change meanwhile. True if ours changed, False if they
        were equal after all, None if the chunk kept changing."""
        store = self._store(target)
        for _ in range(3):
            rec0 = await self._io(store.committed, cid)
            try:
                meta: ChunkMeta | None
                meta, data = await self._fetch(source, cid)
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    raise
                meta, data = None, bytearray()
            async with self.locks.update(target, cid):
                rec = await self._io(store.committed, cid)
                if not same_record(rec, rec0):
                    continue
                if meta is None:
                    if rec is None:
                        return False
                    await self._io(store.remove_chunk, cid)
                    log.warning(
                        "removed divergent chunk target=%d chunk=%s (the head target=%d has none)",
                        target,
                        cid.hex(),
                        source["id"],
                    )
                    return True
                if rec is not None and rec.version == meta["version"]:
                    try:
                        _, ours = await self._io(store.read_full, cid)
                        if ours == data:
                            return False
                    except FsError as exc:
                        if exc.code != errno.EIO:
                            raise
                await self._install(store, cid, data, meta["chunk_size"], meta["version"])
            log.warning(
                "repaired divergent chunk target=%d chunk=%s from the head target=%d "
                "version=%d (ours: %s)",
                target,
                cid.hex(),
                source["id"],
                meta["version"],
                "none" if rec0 is None else rec0.version,
            )
            return True
        return None

    # ---- scrub ---------------------------------------------------------------------

    @rpc_method
    async def scrub(self, target: int, after: bytes | None = None, limit: int = 64) -> ScrubResult:
        """Verify every block of up to *limit* chunks after *after* (chunk-id
        order), repair damaged ones from a healthy replica, and compare the
        page with the chain's head (versions and checksums), repairing our
        copy where it diverges. ``next`` is the cursor of the following page."""
        store = self._store(target)
        if not 1 <= limit <= SCRUB_MAX:
            raise FsError(errno.EINVAL, f"limit {limit} must be in [1, {SCRUB_MAX}]")
        page = await self._io(store.list_chunks, after, limit)
        chunks = page["chunks"]
        counts = _ScrubCounts()
        for info in chunks:
            cid = info["chunk"]
            problem = await self._io(store.verify, cid)
            counts.checked += 1
            if problem is None:
                continue
            counts.corrupt += 1
            counts.handled.add(cid)
            log.error("scrub target=%d chunk=%s: %s", target, cid.hex(), problem)
            if await self.repair(target, cid):
                counts.repaired += 1
            else:
                counts.unrecoverable += 1
        bound = chunks[-1]["chunk"] if page["more"] and chunks else None
        head = self._scrub_head(target)
        if head is not None:
            await self._scrub_compare(target, head, after, bound, counts)
        if counts.corrupt or counts.divergent:
            log.warning(
                "scrub target=%d checked=%d corrupt=%d divergent=%d repaired=%d unrecoverable=%d",
                target,
                counts.checked,
                counts.corrupt,
                counts.divergent,
                counts.repaired,
                counts.unrecoverable,
            )
        return {
            "checked": counts.checked,
            "corrupt": counts.corrupt,
            "divergent": counts.divergent,
            "repaired": counts.repaired,
            "unrecoverable": counts.unrecoverable,
            "next": bound,
        }

    def _scrub_head(self, target: int) -> TargetInfo | None:
        """The head to compare with: only a serving replica other than the
        head compares (a syncing one is being made equal by resync)."""
        routing = self._routing_now()
        chain = chain_of(routing, target) if routing is not None else None
        if routing is None or chain is None:
            return None
        serving = routing.serving_targets(chain["id"])
        if not serving or serving[0]["id"] == target:
            return None
        if target not in [t["id"] for t in serving]:
            return None
        return serving[0]

    async def _scrub_compare(
        self,
        target: int,
        head: TargetInfo,
        after: bytes | None,
        bound: bytes | None,
        counts: _ScrubCounts,
    ) -> None:
        routing = self._routing_now()
        if routing is None or self.rpc is None:
            return
        store = self._store(target)
        stub = StorageStub(self.rpc, routing.target_address(head["id"]), timeout=COPY_TIMEOUT)
        theirs: dict[bytes, ChunkInfo] = {}
        cursor = after
        while True:
            page = await stub.list_chunks(head["id"], cursor, RESYNC_PAGE)
            done = not page["more"] or not page["chunks"]
            for info in page["chunks"]:
                if bound is not None and info["chunk"] > bound:
                    done = True
                    break
                theirs[info["chunk"]] = info
            if done:
                break
            cursor = page["chunks"][-1]["chunk"]
        ours = await self._io(store.list_range, after, bound)
        for cid in sorted(set(theirs) | set(ours)):
            if cid in counts.handled:
                continue
            mine, head_info = ours.get(cid), theirs.get(cid)
            if mine is not None and head_info is not None and same_info(mine, head_info):
                continue
            try:
                changed = await self._reconcile(target, head, cid)
            except FsError as exc:
                log.warning(
                    "scrub target=%d chunk=%s: comparing with the head failed: %s",
                    target,
                    cid.hex(),
                    exc.message,
                )
                continue
            if changed:
                counts.divergent += 1
                counts.repaired += 1

    async def _scrub_loop(self) -> None:
        """The periodic background scrub (``scrub_interval`` seconds apart)."""
        while True:
            await trio.sleep(self.scrub_interval)
            for store in list(self.stores):
                if store.target_id is None:
                    continue
                totals = dict.fromkeys(
                    ("checked", "corrupt", "divergent", "repaired", "unrecoverable"), 0
                )
                after: bytes | None = None
                try:
                    while True:
                        result = await self.scrub(store.target_id, after, SCRUB_PAGE)
                        for key in totals:
                            totals[key] += result[key]
                        after = result["next"]
                        if after is None:
                            break
                except FsError as exc:
                    log.warning("periodic scrub target=%d failed: %s", store.target_id, exc.message)
                    continue
                except Exception:  # a bug: logged, the daemon keeps serving
                    log.exception("periodic scrub target=%d failed unexpectedly", store.target_id)
                    continue
                log.info(
                    "periodic scrub target=%d %s",
                    store.target_id,
                    " ".join(f"{k}={v}" for k, v in totals.items()),
                )

    # ---- resync -------------------------------------------------------------------

    def _sync_state(self, target: int, chain: int, chain_version: int) -> SyncState:
        state = self._sync.get(target)
        if state is None or (state.chain, state.chain_version) != (chain, chain_version):
            state = SyncState(chain, chain_version)
            self._sync[target] = state
        return state

    def _sync_of(self, target: int, place: Place | None) -> SyncState | None:
        if place is None or not place.syncing:
            return None
        return self._sync_state(target, place.chain, place.version)

    async def _resync_supervisor(self, nursery: trio.Nursery) -> None:
        """Start a resync for every one of our targets the routing map shows
        syncing; forget sync state of targets that serve again."""
        while True:
            routing = self._routing_now()
            if routing is not None:
                for store in list(self.stores):
                    tid = store.target_id
                    info = routing.targets.get(tid) if tid is not None else None
                    if tid is None or info is None:
                        continue
                    if info["state"] == "syncing":
                        if tid not in self._resyncing:
                            self._resyncing.add(tid)
                            nursery.start_soon(self._resync_task, tid)
                    elif tid not in self._resyncing:
                        self._sync.pop(tid, None)
            await trio.sleep(RESYNC_POLL)

    async def _resync_task(self, target: int) -> None:
        """One target's resync; a bug in it is logged and the supervisor
        starts it again, rather than taking the whole daemon down."""
        try:
            await self.resync(target)
        except Exception:
            log.exception("resync target=%d failed unexpectedly", target)
            await trio.sleep(1.0)
        finally:
            self._resyncing.discard(target)

    async def resync(self, target: int) -> None:
        """Bring *target* up to date while the routing map shows it syncing,
        until mgmtd accepts `sync_done`; a pass that meets a chain change
        (ESTALE) starts over."""
        assert self.routing is not None
        delay = 0.2
        while True:
            routing = self._routing_now()
            if routing is None:
                return
            chain = chain_of(routing, target)
            me = routing.targets.get(target)
            if chain is None or me is None or me["state"] != "syncing":
                self._sync.pop(target, None)
                return
            try:
                await self._resync_pass(target, routing, chain)
                delay = 0.2
            except _ChainChanged:
                log.info("resync target=%d: the chain changed, starting over", target)
            except FsError as exc:
                if exc.code == errno.ESTALE:
                    log.info("resync target=%d: %s; starting over", target, exc.message)
                else:
                    log.warning(
                        "resync target=%d failed: %s; retry in %.1fs", target, exc.message, delay
                    )
                    await trio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            with contextlib.suppress(FsError):
                await self.routing.refresh()

    def _still_current(self, target: int, sync: SyncState) -> None:
        if self._sync.get(target) is not sync:
            raise _ChainChanged()

    async def _resync_pass(self, target: int, routing: Routing, chain: ChainInfo) -> None:
        if self.rpc is None or self.mgmtd is None:
            raise FsError(errno.EHOSTDOWN, "no rpc client or mgmtd to resync with")
        store = self._store(target)
        start_version = chain["version"]
        sources = [t for t in routing.serving_targets(chain["id"]) if t["id"] != target]
        if not sources:
            raise FsError(errno.EAGAIN, f"chain {chain['id']} has no serving replica to sync from")
        source = sources[-1]  # the nearest serving one upstream: spares the head
        stub = StorageStub(self.rpc, routing.target_address(source["id"]), timeout=COPY_TIMEOUT)
        sync = self._sync_state(target, chain["id"], start_version)
        stats = ResyncStats(target, chain["id"], source["id"])
        started = trio.current_time()
        log.info(
            "resync start target=%d chain=%d chain_version=%d source=%d",
            target,
            chain["id"],
            start_version,
            source["id"],
        )
        after: bytes | None = None
        while True:
            self._still_current(target, sync)
            seq0 = sync.seq
            page = await stub.list_chunks(source["id"], after, RESYNC_PAGE)
            theirs = page["chunks"]
            more = page["more"] and bool(theirs)
            # ours in the same id range (on the last page: up to its last chunk;
            # ours past it are paged through below)
            bound = theirs[-1]["chunk"] if theirs else after
            ours = await self._io(store.list_range, after, bound) if theirs else {}
            for info in theirs:
                cid = info["chunk"]
                mine = ours.pop(cid, None)
                stats.chunks_checked += 1
                if cid in sync.trusted:
                    continue
                if mine is not None and not sync.touched_since(cid, seq0) and same_info(mine, info):
                    sync.trusted.add(cid)
                    continue
                await self._resync_chunk(target, store, sync, stub, source["id"], cid, stats)
            for cid in ours:  # ours only: removed on the chain while we were away?
                if cid not in sync.trusted:
                    await self._resync_chunk(target, store, sync, stub, source["id"], cid, stats)
            after = bound
            if not more:
                break
        while True:  # ours past the source's last chunk
            self._still_current(target, sync)
            tail = await self._io(store.list_chunks, after, RESYNC_PAGE)
            for info in tail["chunks"]:
                if info["chunk"] not in sync.trusted:
                    await self._resync_chunk(
                        target, store, sync, stub, source["id"], info["chunk"], stats
                    )
            if not tail["more"] or not tail["chunks"]:
                break
            after = tail["chunks"][-1]["chunk"]
        self._still_current(target, sync)
        await self.mgmtd.sync_done(target, chain["id"], start_version)
        stats.forwarded = sync.forwarded
        stats.seconds = trio.current_time() - started
        self.resyncs.append(stats)
        log.info(
            "resync done target=%d chain=%d source=%d chunks_checked=%d chunks_copied=%d "
            "bytes_copied=%d chunks_deleted=%d forwarded_while_syncing=%d seconds=%.3f "
            "throughput_mb_s=%.1f",
            target,
            chain["id"],
            source["id"],
            stats.chunks_checked,
            stats.chunks_copied,
            stats.bytes_copied,
            stats.chunks_deleted,
            stats.forwarded,
            stats.seconds,
            stats.bytes_copied / max(stats.seconds, 1e-6) / 1e6,
        )

    async def _resync_chunk(
        self,
        target: int,
        store: ChunkStore,
        sync: SyncState,
        stub: StorageStub,
        source: int,
        cid: bytes,
        stats: ResyncStats,
    ) -> None:
        """Make our copy of *cid* the source's: read it there (under the
        source's chunk lock, so it includes every update that reached us),
        install it here unless the chain changed the chunk here since (then
        read again) or made it trusted (then ours is right)."""
        for _ in range(RESYNC_RETRIES):
            self._still_current(target, sync)
            seq0 = sync.seq
            meta: ChunkMeta | None
            try:
                meta, data = await stub.read_chunk(source, cid)
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    raise
                meta, data = None, bytearray()
            async with self.locks.update(target, cid):
                self._still_current(target, sync)
                if cid in sync.trusted:
                    return
                if sync.touched_since(cid, seq0):
                    continue
                if meta is None:
                    if await self._io(store.remove_chunk, cid):
                        stats.chunks_deleted += 1
                else:
                    await self._install(store, cid, data, meta["chunk_size"], meta["version"])
                    stats.chunks_copied += 1
                    stats.bytes_copied += len(data)
                sync.trusted.add(cid)
                return
        raise FsError(errno.EAGAIN, f"chunk {cid.hex()} kept changing during resync")

    # ---- adding targets --------------------------------------------------------------

    @rpc_method
    async def add_target(self, path: str) -> dict[str, int]:
        """Format (or open) *path* as a new target of this node, persist it so
        a restart keeps serving it, and register it with mgmtd (which makes it
        a spare until `assign_target` puts it into a chain)."""
        if self.open_target is None or self.on_targets_changed is None:
            raise FsError(errno.EOPNOTSUPP, "this storage service cannot add targets")
        if not os.path.isabs(path):
            raise FsError(errno.EINVAL, f"target path {path!r} must be absolute")
        async with self._add_lock:
            real = os.path.realpath(path)
            for s in self.stores:
                if os.path.realpath(s.path) == real:
                    raise FsError(errno.EEXIST, f"{path} is already a target of this node")
            store = await trio.to_thread.run_sync(self.open_target, path)
            clusters = {s.cluster_id for s in self.stores if s.cluster_id is not None}
            if store.cluster_id is not None and clusters and store.cluster_id not in clusters:
                store.close()
                raise FsError(
                    errno.EINVAL, f"{path} is a target of cluster {store.cluster_id}, not ours"
                )
            self.stores.append(store)
            try:
                await self.refresh_usage()
                await self.on_targets_changed()
            except BaseException:
                self.stores.remove(store)
                self.reindex()
                store.close()
                raise
            if store.target_id is None:
                raise FsError(errno.EIO, f"mgmtd assigned no id to the new target {path}")
            log.info("added target=%d path=%s", store.target_id, store.path)
            return {"target_id": store.target_id}

    # ---- background work ---------------------------------------------------------------

    async def run_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Repair worker, resync supervisor and (if configured) the periodic
        scrub, until cancelled."""
        send, receive = trio.open_memory_channel[tuple[int, bytes]](REPAIR_QUEUE)
        self._repair_send = send
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._repair_worker, receive)
                if self.routing is not None:
                    nursery.start_soon(self._resync_supervisor, nursery)
                if self.scrub_interval > 0:
                    nursery.start_soon(self._scrub_loop)
                task_status.started()
        finally:
            self._repair_send = None
            self._repair_pending.clear()


# ---- the daemon ------------------------------------------------------------


def _load_node_state(path: Path) -> dict[str, Any]:
    """node.json: the node id and cluster id mgmtd gave us, and the targets
    added at runtime (``shufflefs target add``) beyond the config's."""
    if not path.exists():
        return {"node_id": None, "cluster_id": None, "targets": []}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FsError(errno.EIO, f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict):
        raise FsError(errno.EIO, f"{path} is not a json object")
    added = state.get("targets", [])
    if not isinstance(added, list) or not all(isinstance(p, str) for p in added):
        raise FsError(errno.EIO, f"{path}: 'targets' is not a list of paths")
    return {
        "node_id": state.get("node_id"),
        "cluster_id": state.get("cluster_id"),
        "targets": added,
    }


def _save_node_state(path: Path, node: dict[str, Any], fsync: bool) -> None:
    state = {"node_id": node["node_id"], "cluster_id": node["cluster_id"]}
    if node["targets"]:
        state["targets"] = list(node["targets"])
    write_json_durably(path, state, fsync)


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
    got = raise_fd_limit(wanted)
    if got < wanted:
        log.warning("open file limit %d is below the %d the fd caches may use", got, wanted)


def _open_store(config: StorageConfig, path: str) -> ChunkStore:
    return ChunkStore(
        path,
        block_size=config.block_size,
        fsync=config.fsync,
        reserve_bytes=config.reserve_bytes,
        fd_cache=config.fd_cache,
        max_readers=max(126, 4 * config.io_threads + 32),
    )


class StorageDaemon:
    """One storage node: its targets, the rpc server, registration and
    heartbeats, the routing map and the background work. `serve` runs one;
    tests run several in one process and reach into them."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.service: StorageService | None = None
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
        config.validate()
        secret = load_secret(Path(config.secret_file))
        data_dir = Path(config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        node_file = data_dir / NODE_FILE
        node = _load_node_state(node_file)
        configured = {os.path.realpath(t) for t in config.targets}
        paths = list(config.targets) + [
            p for p in node["targets"] if os.path.realpath(p) not in configured
        ]
        _raise_fd_limit(config.fd_cache * (len(paths) + 4) + 1024)
        stores: list[ChunkStore] = []
        service: StorageService | None = None
        registered: int | None = None  # our node id once mgmtd accepted us this run
        try:
            for path in paths:
                stores.append(await trio.to_thread.run_sync(_open_store, config, path))
            cluster_id = _cluster_of(node, stores)
            service = StorageService(
                stores,
                io_threads=config.io_threads,
                forward_timeout=config.forward_timeout,
                scrub_interval=config.scrub_interval,
                open_target=functools.partial(_open_store, config),
            )
            self.service = service
            await service.refresh_usage()
            server = RpcServer(secret, [service], name="storage")
            host, port = _listen_address(config.listen)

            def on_registered(result: RegisterResult) -> None:
                assert service is not None
                if (result["node_id"], result["cluster_id"]) != (
                    node["node_id"],
                    node["cluster_id"],
                ):
                    node.update(node_id=result["node_id"], cluster_id=result["cluster_id"])
                    _save_node_state(node_file, node, config.fsync)
                # the registration listed our stores in order; a target added
                # meanwhile (appended) is registered by the next registration
                current = list(service.stores)
                ids = result["target_ids"]
                if len(ids) > len(current):
                    raise FsError(
                        errno.EPROTO, f"mgmtd assigned {len(ids)} target ids for {len(current)}"
                    )
                for store, target_id in zip(current, ids, strict=False):
                    store.set_identity(target_id, result["cluster_id"])
                service.reindex()

            async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
                self.cancel_scope = nursery.cancel_scope
                routing = RoutingCache(rpc, config.mgmtd)
                self.routing = routing
                mgmtd = MgmtdStub(rpc, config.mgmtd)
                # before the first request can arrive: without a routing map a
                # write would apply here alone, unreplicated (with one that is
                # not fetched yet, it is refused with ESTALE)
                service.routing, service.rpc, service.mgmtd = routing, rpc, mgmtd
                routing.listeners.append(service.routing_changed)
                port = await nursery.start(server.serve, host, port)
                self.port = port
                address = config.advertise or _advertised(host, port)
                self.address = address

                async def on_routing_version(version: int) -> None:
                    await routing.refresh(version)

                agent = NodeAgent(
                    mgmtd,
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

                async def targets_changed() -> None:
                    """A target was added: remember it, then register again so
                    mgmtd gives it an id (bounded: mgmtd may be down)."""
                    assert service is not None
                    added = [
                        str(s.path)
                        for s in service.stores
                        if os.path.realpath(s.path) not in configured
                    ]
                    node["targets"] = added
                    _save_node_state(node_file, node, config.fsync)
                    with trio.fail_after(REPORT_TIMEOUT * 2):
                        await agent.register()

                await nursery.start(agent.run)
                registered = self.node_id = agent.node_id
                await routing.start(nursery)
                service.node_id = agent.node_id
                service.on_targets_changed = targets_changed
                nursery.start_soon(service.usage_loop)
                await nursery.start(service.run_background)
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
            for store in service.stores if service is not None else stores:
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
