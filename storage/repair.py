"""`RepairWorker`: replace a damaged chunk with a healthy replica's copy
(docs/storage.md "Repair and scrub").

A read, a write or a copy that meets a checksum mismatch fails with EIO (the
client reads another replica) and queues the chunk here; the worker fetches
the chunk from another serving replica at a version no older than ours and
installs it under the chunk's lock, unless the chunk changed meanwhile.
"""

from __future__ import annotations

import collections
import logging

import trio

from shufflefs.cluster.protocol import TargetInfo
from shufflefs.rpc import FsError
from shufflefs.storage.context import NodeContext
from shufflefs.storage.layout import same_record
from shufflefs.storage.protocol import ChunkMeta
from shufflefs.storage.resync import ResyncWorker

log = logging.getLogger("shufflefs.storage.repair")

REPAIR_QUEUE = 4096  # chunks waiting for repair; beyond that, damage is only logged
# A chunk no replica could repair is not queued again for this long: when every
# copy is damaged, each repair attempt reads the other copies, finds them
# damaged too and would queue their repairs, round and round. (scrub always tries.)
REPAIR_COOLDOWN = 300.0
REPAIR_TRIES = 3  # looks at a chunk that keeps being rewritten while we fetch a copy

RepairKey = tuple[int, bytes]  # (target, chunk id)


class RepairWorker:
    """The queue of damaged chunks and the task that repairs them."""

    def __init__(self, node: NodeContext, resync: ResyncWorker) -> None:
        self.node = node
        self.resync = resync
        self.running = False  # queueing is pointless without the worker
        self._queue: collections.deque[RepairKey] = collections.deque()
        self._pending: set[RepairKey] = set()  # queued or being repaired
        self._failed: dict[RepairKey, float] = {}  # no replica could repair -> when (trio clock)
        self._wakeup = trio.Event()
        self._busy = trio.Lock()

    def schedule(self, target: int, cid: bytes) -> None:
        """Queue a damaged chunk for repair from a healthy replica (once)."""
        key = (target, cid)
        if key in self._pending:
            return
        failed = self._failed.get(key)
        if failed is not None and trio.current_time() - failed < REPAIR_COOLDOWN:
            return
        if not self.running:
            log.debug("no repair worker: target=%d chunk=%s stays damaged", target, cid.hex())
            return
        if len(self._queue) >= REPAIR_QUEUE:
            log.warning("repair queue full: target=%d chunk=%s not queued", target, cid.hex())
            return
        self._queue.append(key)
        self._pending.add(key)
        self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Repair queued chunks as they come, until cancelled."""
        self.running = True
        try:
            task_status.started()
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                await self.run_once()
        finally:
            self.running = False
            self._queue.clear()
            self._pending.clear()

    async def run_once(self) -> None:
        """Repair every chunk queued now; returns when none is left, including
        ones another caller (the worker) was repairing meanwhile."""
        async with self._busy:
            while self._queue:
                target, cid = self._queue.popleft()
                await self._repair_queued(target, cid)

    async def _repair_queued(self, target: int, cid: bytes) -> None:
        healthy = False
        try:
            healthy = await self.repair(target, cid)
        except FsError as exc:
            log.warning("repair target=%d chunk=%s failed: %s", target, cid.hex(), exc.message)
        except Exception:  # a bug: logged, the worker goes on
            log.exception("repair target=%d chunk=%s failed unexpectedly", target, cid.hex())
        finally:
            self._pending.discard((target, cid))
        if healthy:
            self._failed.pop((target, cid), None)
        else:
            now = trio.current_time()
            self._failed[(target, cid)] = now
            for key, when in list(self._failed.items()):  # keep it small
                if now - when >= REPAIR_COOLDOWN:
                    del self._failed[key]

    async def repair(self, target: int, cid: bytes) -> bool:
        """Replace a damaged chunk of *target* with a healthy replica's copy, at
        that replica's version. True if the chunk is healthy afterwards (or
        gone); False if no other serving replica had a healthy copy
        (logged as unrecoverable)."""
        node = self.node
        store = node.store(target)
        for _ in range(REPAIR_TRIES):
            rec0 = await node.io(store.committed, cid)
            if rec0 is None:
                return True
            sources = node.other_serving(target)
            fetched: tuple[TargetInfo, ChunkMeta, bytearray] | None = None
            for source in sources:
                try:
                    meta, data = await node.fetch(source, cid)
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
            async with node.locks.update(target, cid):
                rec = await node.io(store.committed, cid)
                if not same_record(rec, rec0):
                    continue  # rewritten meanwhile: look again
                if await node.io(store.verify, cid) is None:
                    return True
                await node.install(store, cid, data, meta["chunk_size"], meta["version"])
                self.resync.touch(target, cid)
            log.warning(
                "repaired target=%d chunk=%s from target=%d version=%d bytes=%d",
                target,
                cid.hex(),
                source["id"],
                meta["version"],
                len(data),
            )
            return True
        return await node.io(store.verify, cid) is None
