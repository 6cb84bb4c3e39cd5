"""`StorageService`: the storage daemon's rpc handlers, over this node's targets.

Each handler does its part on the local targets (`ChunkStore`, in worker
threads bounded by ``io_threads`` so a cold pread or an fsync never stalls
the event loop) and hands the rest to the node's roles: `Forwarding` sends
updates down the chain, `RepairWorker` heals damaged chunks, `ResyncWorker`
brings syncing targets up to date, `ScrubWorker` verifies. The protocols are
described once, in docs/storage.md. The read methods are its base,
`ReadHandlers` (storage/read_service.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import trio

from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.rpc import FsError, RpcClient, rpc_method
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.storage.batch_writes import BatchWrites
from shufflefs.storage.capacity import CapacityFigures
from shufflefs.storage.chain import Place
from shufflefs.storage.context import NodeContext, RoutingSource
from shufflefs.storage.forwarding import ForwardedUpdate, Forwarding
from shufflefs.storage.layout import check_chunk_id, check_chunk_size
from shufflefs.storage.protocol import (
    FORWARD_TIMEOUT,
    MAX_FILES_REMOVED,
    SYNC_BARRIER_TIMEOUT,
    ChunkInfo,
    ChunkPage,
    ReplicateItem,
    ScrubResult,
    TargetStats,
    WriteItem,
    WriteOutcome,
    WriteResult,
)
from shufflefs.storage.read_service import ReadHandlers
from shufflefs.storage.repair import RepairWorker
from shufflefs.storage.resync import ResyncWorker
from shufflefs.storage.scrub import ScrubWorker
from shufflefs.storage.staging import Staged
from shufflefs.storage.store import ChunkStore
from shufflefs.storage.write_steps import (
    OwnCopyDamaged,
    head_update,
    stage_at_head,
    stage_forwarded,
)

log = logging.getLogger("shufflefs.storage")


class StorageService(ReadHandlers):
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
        self.node = NodeContext(
            stores, io_threads=io_threads, routing=routing, rpc=rpc, mgmtd=mgmtd, node_id=node_id
        )
        self.capacity = CapacityFigures(self.node)
        self.forwarding = Forwarding(self.node, forward_timeout)
        self.resyncer = ResyncWorker(self.node)
        self.repairs = RepairWorker(self.node, self.resyncer)
        self.batches = BatchWrites(self.node, self.forwarding, self.resyncer, self._damaged_here)
        self.scrubber = ScrubWorker(self.node, self.repairs, self.resyncer, scrub_interval)
        super().__init__(self.node, self.repairs, max_read_bytes)
        self.open_target = open_target
        self.on_targets_changed = on_targets_changed
        self._add_lock = trio.Lock()

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
        """A client's write, at the chain's head: stage it here while it is
        forwarded along the chain, commit once both are done."""
        node = self.node
        store = node.store(target)
        check_chunk_id(chunk)
        data = payload if payload is not None else b""
        async with (
            node.locks.update(target, chunk),
            self.forwarding.admitted(target, chain, chain_version, head=True) as place,
        ):
            if place is not None:
                place = await self.forwarding.check_min_replicas(place, target, head=True)
            stage = partial(stage_at_head, store, chunk, offset, data, chunk_size)
            update = None
            if place is not None and place.successor is not None:
                update = head_update(store, chunk, offset, chunk_size, len(data))
            if update is None or place is None:
                # nothing to forward (a lone replica, a zero-length write, or
                # one that stage refuses): stage, flush and commit in one step
                try:
                    return await node.updates(store).write(chunk, stage)
                except FsError as exc:
                    raise self._damaged_here(target, chunk, exc) from None
            return await self._stage_forward_commit(
                store, update, place, data, stage, partial(self._damaged_here, target, chunk)
            )

    def _damaged_here(self, target: int, chunk: bytes, exc: FsError) -> FsError:
        """A head's own copy could not take a write (`OwnCopyDamaged`):
        it is repaired from another replica and the client retries
        (EAGAIN); any other error as it is."""
        if isinstance(exc, OwnCopyDamaged) and self.node.other_serving(target):
            self.repairs.schedule(target, chunk)
            return FsError(
                errno.EAGAIN,
                f"{exc.message}; the chunk is being repaired from another replica, retry",
            )
        return exc

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
        stage it while forwarding it to our successor, commit once both are
        done. A delta applies only on *base_version* (else `NEED_FULL`);
        ``full`` carries the whole new chunk."""
        node = self.node
        store = node.store(target)
        check_chunk_id(chunk)
        data = payload if payload is not None else b""
        if not full and version != base_version + 1:
            raise FsError(
                errno.EINVAL, f"version {version} does not follow base_version {base_version}"
            )
        async with (
            node.locks.update(target, chunk),
            self.forwarding.admitted(target, chain, chain_version, head=False) as place,
        ):
            sync = self.resyncer.state_at(target, place)
            stage = partial(stage_forwarded, store, chunk, offset, chunk_size, version, full, data)
            if place is None or place.successor is None:
                # the tail: nothing to forward, so stage, flush and commit in
                # one step
                result = await node.updates(store).write(chunk, stage)
            else:
                store.check_room(len(data))  # a full disk here: forward nothing
                update = ForwardedUpdate(chunk, offset, chunk_size, version, base_version, full)
                result = await self._stage_forward_commit(store, update, place, data, stage)
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

    @rpc_method
    async def write_many(
        self, items: list[WriteItem], payload: bytearray | None
    ) -> dict[str, list[WriteOutcome]]:
        """Many `write`s in one request, each chunk at most once per target
        (storage/batch_writes.py): per item ``[0, version, length]`` or
        ``[errno, message]``, each exactly what its own `write` answers."""
        return {"outcomes": await self.batches.write_many(items, payload)}

    @rpc_method
    async def replicate_many(
        self, items: list[ReplicateItem], payload: bytearray | None
    ) -> dict[str, list[WriteOutcome]]:
        """Many `replicate`s in one request: what a replica forwards of a
        `write_many` (or of its own `replicate_many`)."""
        return {"outcomes": await self.batches.replicate_many(items, payload)}

    async def _stage_forward_commit(
        self,
        store: ChunkStore,
        update: ForwardedUpdate,
        place: Place,
        data: bytes | bytearray,
        stage: Callable[[], Staged],
        stage_error: Callable[[FsError], FsError] | None = None,
    ) -> WriteResult:
        """An update with a successor: staged and flushed here (one worker
        thread step) while it is forwarded, so this replica's disk work
        overlaps the rest of the chain's; committed once both are done. On
        any failure it is aborted here, so nothing is committed here that is
        not durable here and acknowledged by the rest of the chain. A
        successor may have taken an update that then fails here (a full
        disk): it is a version ahead, and the next update of the chunk
        finds it so (`NEED_FULL`) and resends the whole chunk as staged
        here. *stage_error* maps an error of this replica's stage."""
        updates = self.node.updates(store)
        staged: Staged | None = None
        local_error: list[FsError] = []
        local_done = trio.Event()

        async def stage_here() -> None:
            nonlocal staged
            try:
                staged = await updates.stage_durably(update.cid, stage)
            except FsError as exc:
                local_error.append(stage_error(exc) if stage_error is not None else exc)
            finally:
                local_done.set()

        async def whole_chunk() -> bytes:
            await local_done.wait()
            if staged is None:
                raise FsError(local_error[0].code, local_error[0].message)
            return await self.node.io(store.staged_content, staged)

        try:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stage_here)
                    await self.forwarding.forward_update(update, place, data, whole_chunk)
            except BaseExceptionGroup as group:
                if local_error:
                    raise local_error[0] from None
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
            if local_error:
                raise local_error[0]
            assert staged is not None
            return await updates.commit(staged)
        except BaseException:
            with trio.CancelScope(shield=True):
                await local_done.wait()  # (its step runs to its end, shielded)
                if staged is not None:
                    await self.node.io(store.abort, staged)
            raise

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

    @rpc_method
    async def remove_files(
        self, target: int, chain: int, chain_version: int, inos: list[int]
    ) -> dict[str, int]:
        """`remove_file` of each of *inos* on *chain*, on every replica, in
        one call per hop (garbage collection's batches of freed files)."""
        return {"removed": await self._files_removed(target, chain, chain_version, inos, True)}

    @rpc_method
    async def replicate_remove_files(
        self, target: int, chain: int, chain_version: int, inos: list[int]
    ) -> dict[str, int]:
        """`remove_files` forwarded by our predecessor."""
        return {"removed": await self._files_removed(target, chain, chain_version, inos, False)}

    async def _files_removed(
        self, target: int, chain: int, chain_version: int, inos: list[int], head: bool
    ) -> int:
        """`_file_op`'s removal for many files, in one worker-thread call."""
        store = self.node.store(target)
        if len(inos) > MAX_FILES_REMOVED:
            raise FsError(errno.EINVAL, f"{len(inos)} files to remove > {MAX_FILES_REMOVED}")
        files = sorted(set(inos))

        async def forward(place: Place) -> None:
            await self.forwarding.forward_files_removal(place, files)

        return await self._whole_files_op(
            target, chain, chain_version, files, head, forward, lambda: store.remove_files(files)
        )

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
        chain (`_whole_files_op`)."""
        store = self.node.store(target)
        if size is not None:
            check_chunk_size(chunk_size)
            if size < 0:
                raise FsError(errno.EINVAL, f"negative size {size}")

        async def forward(place: Place) -> None:
            await self.forwarding.forward_file_op(place, ino, size, chunk_size)

        def apply() -> int:
            if size is None:
                return store.remove_file(ino)
            return store.truncate_file(ino, size, chunk_size)

        return await self._whole_files_op(target, chain, chain_version, [ino], head, forward, apply)

    async def _whole_files_op(
        self,
        target: int,
        chain: int,
        chain_version: int,
        inos: list[int],
        head: bool,
        forward: Callable[[Place], Awaitable[None]],
        apply: Callable[[], int],
    ) -> int:
        """An operation on whole files here and down the chain, holding each
        file's lock exclusively (taken in the order of *inos*, sorted by the
        callers, so that two batches never wait for each other): the
        successor first (*forward*), this replica after its ack (*apply*, in
        a worker thread), like a write. Every call is idempotent."""
        node = self.node
        for ino in inos:
            if not 0 <= ino < 1 << 64:
                raise FsError(errno.EINVAL, f"inode {ino} out of range")
        async with contextlib.AsyncExitStack() as held:
            for ino in inos:
                await held.enter_async_context(node.locks.whole_file(target, ino))
            async with self.forwarding.admitted(target, chain, chain_version, head=head) as place:
                if place is not None and place.successor is not None:
                    await forward(place)
                n = await node.io(apply)
                sync = self.resyncer.state_at(target, place)
                if sync is not None:
                    for ino in inos:
                        sync.touch_file(ino)
                    sync.forwarded += 1
        return n

    # ---- inspection and scrub ------------------------------------------------

    @rpc_method
    async def chunk_info(self, target: int, chunk: bytes) -> ChunkInfo:
        store = self.node.store(target)
        return await self.node.io(store.chunk_info, chunk)

    @rpc_method
    async def sync_barrier(self, target: int, chain: int, chain_version: int) -> dict[str, int]:
        """For a syncing tail, before it compares its chunks with this
        replica's: *target* takes updates at *chain_version*, and the updates
        it took at an older one are done (docs/storage.md "Resync")."""
        self.node.store(target)  # ENOENT for a target we do not have
        await self.forwarding.barrier(target, chain, chain_version, SYNC_BARRIER_TIMEOUT)
        return {"chain_version": chain_version}

    @rpc_method
    async def list_chunks(
        self, target: int, after: bytes | None = None, limit: int = 1000
    ) -> ChunkPage:
        store = self.node.store(target)
        return await self.node.io(store.list_chunks, after, limit)

    @rpc_method
    async def stats(self) -> dict[str, list[TargetStats]]:
        """Every registered target of this node (unregistered ones have no id)."""
        stores = list(self.node.by_id.values())
        return {"targets": await self.node.io(lambda: [s.stats() for s in stores])}

    @rpc_method
    async def scrub(self, target: int, after: bytes | None = None, limit: int = 64) -> ScrubResult:
        """One page of `ScrubWorker.scrub_page` (``shufflefs scrub`` pages through)."""
        return await self.scrubber.scrub_page(target, after, limit)

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
        stores = self.node.stores
        async with self._add_lock:
            real = os.path.realpath(path)
            for s in stores:
                if os.path.realpath(s.path) == real:
                    raise FsError(errno.EEXIST, f"{path} is already a target of this node")
            store = await trio.to_thread.run_sync(self.open_target, path)
            clusters = {s.cluster_id for s in stores if s.cluster_id is not None}
            if store.cluster_id is not None and clusters and store.cluster_id not in clusters:
                store.close()
                raise FsError(
                    errno.EINVAL, f"{path} is a target of cluster {store.cluster_id}, not ours"
                )
            stores.append(store)
            try:
                await self.capacity.refresh()
                await self.on_targets_changed()
            except BaseException:
                stores.remove(store)
                self.node.reindex()
                store.close()
                raise
            if store.target_id is None:
                raise FsError(errno.EIO, f"mgmtd assigned no id to the new target {path}")
            log.info("added target=%d path=%s", store.target_id, store.path)
            return {"target_id": store.target_id}

    # ---- background work ---------------------------------------------------------------

    async def run_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Repair worker, resync loop and (if configured) the periodic scrub,
        until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.repairs.run)
            if self.node.routing is not None:
                nursery.start_soon(self.resyncer.run)
            if self.scrubber.interval > 0:
                nursery.start_soon(self.scrubber.run)
            task_status.started()
