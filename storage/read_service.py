"""`ReadHandlers`: the storage daemon's read rpc methods (a base of
`StorageService`, storage/service.py), on the event loop, inline in a
connection's reader task, and on a thread channel's I/O thread.

Reads whose record and file are cached and whose bytes are in the page cache
are served with ``preadv2(RWF_NOWAIT)``, which fails instead of blocking: a
hot 4 KiB read then costs microseconds instead of a thread round trip. The
rest wait for the disk through io_uring, the files not held opened in the
ring too: on the event loop (storage/uring.py) those whose record is cached,
up to NOWAIT_MAX (big checksums stay off the loop); on a thread channel's I/O
thread (storage/uring_threads.py) every one. What is left goes to worker
threads, spread so that one request's cold items wait together, not in turn. The protocol is in
docs/storage.md.
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import trio

from shufflefs.rpc import FsError, Reply, rpc_method
from shufflefs.rpc.errors import as_fs_error
from shufflefs.rpc.heap import uninitialized
from shufflefs.storage.context import NodeContext
from shufflefs.storage.layout import MAX_CHUNK_SIZE, check_chunk_id
from shufflefs.storage.protocol import MAX_READ_ITEMS, ChunkMeta, ReadItem
from shufflefs.storage.repair import RepairWorker
from shufflefs.storage.store import NOWAIT_MAX, ChunkStore, ReadPlan
from shufflefs.storage.uring import FileOutcome, FileRead, UringReads, for_this_run
from shufflefs.storage.uring_threads import BlockingUringReads, for_this_thread

log = logging.getLogger("shufflefs.storage")


def _spread(indices: list[int], threads: int) -> list[list[int]]:
    """*indices* cut into at most *threads* runs of about equal length."""
    per = -(-len(indices) // threads)
    return [indices[k : k + per] for k in range(0, len(indices), per)]


Planned = tuple[int, ChunkStore, ReadPlan]  # an item's index, its store, its plan


def _ring_reads(planned: list[Planned]) -> tuple[list[bytearray], list[FileRead]]:
    """A buffer for each plan, and the plans as `open_and_read` takes them
    (the fd held, or the path to open)."""
    bufs = [uninitialized(plan.stop - plan.start) for _, _, plan in planned]
    return bufs, [(p.source, buf, p.start) for (_, _, p), buf in zip(planned, bufs, strict=True)]


def _finish(
    planned: list[Planned],
    bufs: list[bytearray],
    outcomes: list[FileOutcome],
    results: list[memoryview | int],
    left: list[int],
) -> None:
    """Each plan's bytes checked into *results* (`ChunkStore.finish_read`,
    which gives back its fd or keeps the one opened for it), or its index
    in *left*: read short, damaged, failed, or not read at all (*outcomes*
    cut short by a failure of the ring as a whole)."""
    for k, (i, store, plan) in enumerate(planned):
        data: bytearray | None = None
        opened: int | None = None
        if k < len(outcomes):
            fd, got = outcomes[k]
            if plan.handle is None and isinstance(fd, int):
                opened = fd
            if isinstance(got, int):
                data = bufs[k]
                del data[got:]
        found = store.finish_read(plan, data, opened)
        if found is None:
            left.append(i)
        else:
            results[i] = found


def _read_reply(results: list[memoryview | int]) -> Reply:
    lengths = [r if isinstance(r, int) else len(r) for r in results]
    return Reply({"lengths": lengths}, [r for r in results if not isinstance(r, int)])


class ReadHandlers:
    """The read methods over this node's targets; damaged chunks they meet
    are queued with *repairs*."""

    def __init__(self, node: NodeContext, repairs: RepairWorker, max_read_bytes: int) -> None:
        self.node = node
        self.repairs = repairs
        self.max_read_bytes = max_read_bytes
        self._fan_out: ThreadPoolExecutor | None = None

    def _check_read_size(self, items: list[ReadItem]) -> None:
        if len(items) > MAX_READ_ITEMS:
            raise FsError(
                errno.EMSGSIZE, f"read of {len(items)} items exceeds {MAX_READ_ITEMS}: split it"
            )
        total = sum(max(0, item[3]) for item in items)
        if total > self.max_read_bytes:
            raise FsError(
                errno.EMSGSIZE,
                f"read of {total} bytes exceeds the reply limit {self.max_read_bytes}: split it",
            )

    def read_fast(self, items: list[ReadItem]) -> Reply | None:
        """`read` inline in the connection's reader task (or a thread
        channel's thread) when every item is in the page cache (no thread, no
        task); None to run `read` itself. A file not held is opened here if
        its path is in the kernel's caches (storage/cached_open.py); a record
        not cached is read only off the event loop."""
        self._check_read_size(items)
        stores = self._serving(items)
        data: list[memoryview] = []
        lengths: list[int] = []
        # a thread channel's thread may read records that are not cached
        loading = threading.get_ident() != self.node.loop_thread
        for target, chunk, offset, length in items:
            store = stores[target]
            if isinstance(store, int):
                return None
            try:
                got = store.read_nowait(chunk, offset, length, loading)
            except FsError:
                return None
            if got is None:
                return None
            lengths.append(len(got))
            if len(got):
                data.append(got)
        return Reply({"lengths": lengths}, data)

    def _serving(self, items: list[ReadItem]) -> dict[int, ChunkStore | int]:
        """Each target *items* name: its store if it may answer reads
        (`NodeContext.readable`), else the negative errno its items fail with.
        Asked once per target, not per item: a frame has many items and few
        targets."""
        node = self.node
        by_id = node.by_id
        out: dict[int, ChunkStore | int] = {}
        for item in items:
            target = item[0]
            if target in out:
                continue
            store = by_id.get(target)
            if store is None:
                out[target] = -errno.ENOENT
            elif not node.readable(target):
                out[target] = -errno.ESTALE  # not serving (in our map): try another replica
            else:
                out[target] = store
        return out

    @rpc_method(fast="read_fast", threaded="read_sync", disk_bound=True)
    async def read(self, items: list[ReadItem]) -> Reply:
        """Many ranges, possibly on several targets, in one request. Per item
        the delivered length or a negative errno; one payload of all bytes.
        Only committed data is ever returned, and only by a target that serves
        (`NodeContext.readable`; else the item fails with ESTALE). A damaged
        chunk fails its item with EIO (the client reads another replica) and
        is queued for repair.
        Page-cache hits are read here; the rest in worker threads."""
        results, slow = self._read_cached(items)
        if slow:
            await self._read_in_threads(slow, items, results)
        return _read_reply(results)

    def read_sync(self, items: list[ReadItem]) -> Reply:
        """`read` on a thread channel's I/O thread (rpc/channel.py), when
        `read_fast` could not answer: blocking this thread only. Every item
        goes through this thread's io_uring (storage/uring_threads.py), the
        files not held opened there too, so that a request's cold items
        wait for the disk together; what the ring did not settle, and every
        item where there is no io_uring, is read with `ChunkStore.read`,
        spread over up to `io_threads` threads."""
        uring = for_this_thread()
        if uring is None:
            results, slow = self._read_cached(items, loading=True)
        else:
            self._check_read_size(items)
            results = [0] * len(items)
            slow = self._read_opening(uring, items, results)
        if slow:
            first, *others = _spread(slow, self.node.io_threads)
            rest = [
                self._fan_out_pool().submit(self._read_blocking, g, items, results) for g in others
            ]
            self._read_blocking(first, items, results)
            for future in rest:
                future.result()
            damaged = [items[i][:2] for i in slow if results[i] == -errno.EIO]
            if damaged and self.node.trio_token is not None:
                for target, chunk in damaged:
                    self.node.trio_token.run_sync_soon(self.repairs.schedule, target, chunk)
        return _read_reply(results)

    def _read_opening(
        self, uring: BlockingUringReads, items: list[ReadItem], results: list[memoryview | int]
    ) -> list[int]:
        """Every item read through *uring* (records read if not cached,
        files not held opened in the ring: `ChunkStore.read_plan` with
        *opening*); the indices left for `ChunkStore.read` (read short,
        damaged or failed: `read` tells why, or retries)."""
        every = list(range(len(items)))
        planned, left = self._plan(every, items, results, loading=True, opening=True)
        if planned:
            bufs, reads = _ring_reads(planned)
            outcomes: list[FileOutcome] = []
            try:
                outcomes = uring.open_and_read(reads, writable=True)
            finally:
                _finish(planned, bufs, outcomes, results, left)
        return left

    def _read_cached(
        self, items: list[ReadItem], loading: bool = False
    ) -> tuple[list[memoryview | int], list[int]]:
        """Each item's bytes if in the page cache, else its errno (negative);
        and the indices of the items that must wait for the disk. *loading*
        (off the event loop): records not cached are read
        (`ChunkStore.read_nowait`)."""
        self._check_read_size(items)
        stores = self._serving(items)
        results: list[memoryview | int] = [0] * len(items)
        slow: list[int] = []
        for i, (target, chunk, offset, length) in enumerate(items):
            store = stores[target]
            if isinstance(store, int):
                results[i] = store
                continue
            try:
                data = store.read_nowait(chunk, offset, length, loading)
            except FsError as exc:
                results[i] = -exc.code
                continue
            if data is None:
                slow.append(i)
            else:
                results[i] = data
        return results, slow

    def _fan_out_pool(self) -> ThreadPoolExecutor:
        """The threads `read_sync` spreads a request's cold items over (its
        own: a channel's I/O thread waiting on its own pool could deadlock)."""
        if self._fan_out is None:
            self._fan_out = ThreadPoolExecutor(
                self.node.io_threads, thread_name_prefix="storage-read-spread"
            )
        return self._fan_out

    async def _read_in_threads(
        self, slow: list[int], items: list[ReadItem], results: list[memoryview | int]
    ) -> None:
        """Read the items at *slow*: through io_uring those whose record is
        cached (`_read_uring`), the rest (and any the ring's read did not settle)
        with `ChunkStore.read`, spread over the io threads; queue the damaged
        chunks found for repair."""
        uring = for_this_run()
        if uring is not None:
            slow = await self._read_uring(uring, slow, items, results)
            if not slow:
                return
        groups = _spread(slow, self.node.io_threads)
        if len(groups) == 1:
            await self.node.io(self._read_blocking, groups[0], items, results)
        else:
            async with trio.open_nursery() as nursery:
                for group in groups:
                    nursery.start_soon(self.node.io, self._read_blocking, group, items, results)
        for i in slow:
            if results[i] == -errno.EIO:
                self.repairs.schedule(items[i][0], items[i][1])

    async def _read_uring(
        self,
        uring: UringReads,
        slow: list[int],
        items: list[ReadItem],
        results: list[memoryview | int],
    ) -> list[int]:
        """The items at *slow* whose record is cached, read together through
        the loop's ring (a file not held opened there first), for ranges up
        to NOWAIT_MAX (a bigger range's checksums are computed in a thread,
        off the loop); the indices left for `ChunkStore.read` in a thread:
        not planned, or read short, damaged or failed (`read` tells why, or
        retries)."""
        planned, left = self._plan(slow, items, results, NOWAIT_MAX, opening=True)
        if planned:
            bufs, reads = _ring_reads(planned)
            outcomes: list[FileOutcome] = []
            try:
                outcomes = await uring.open_and_read(reads, writable=True)
            finally:
                _finish(planned, bufs, outcomes, results, left)
        return left

    def _plan(
        self,
        slow: list[int],
        items: list[ReadItem],
        results: list[memoryview | int],
        limit: int = MAX_CHUNK_SIZE,
        loading: bool = False,
        opening: bool = False,
    ) -> tuple[list[Planned], list[int]]:
        """The items at *slow* as `ChunkStore.read_plan` plans them (the
        answers it gives at once, and the errno of an item whose target does
        not serve, put in *results*), and the indices it cannot plan (left
        for `ChunkStore.read`)."""
        stores = self._serving([items[i] for i in slow])
        planned: list[Planned] = []
        left: list[int] = []
        for i in slow:
            target, chunk, offset, length = items[i]
            store = stores[target]
            if isinstance(store, int):
                results[i] = store
                continue
            try:
                plan = store.read_plan(chunk, offset, length, limit, loading, opening)
            except FsError as exc:
                results[i] = -exc.code
                continue
            if plan is None:
                left.append(i)
            elif isinstance(plan, memoryview):
                results[i] = plan
            else:
                planned.append((i, store, plan))
        return planned, left

    def _read_blocking(
        self, indices: list[int], items: list[ReadItem], results: list[memoryview | int]
    ) -> None:
        """Worker thread: read the given items into *results* (each its own
        outcome: one bad item never fails the others)."""
        by_id = self.node.by_id
        for i in indices:
            target, chunk, offset, length = items[i]
            try:
                results[i] = by_id[target].read(chunk, offset, length)
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
        store = self.node.store(target)
        check_chunk_id(chunk)
        if not self.node.readable(target):
            raise FsError(errno.ESTALE, f"target {target} is not serving: copy another replica")
        async with self.node.locks.update(target, chunk):
            try:
                rec, data = await self.node.io(store.read_full, chunk)
            except FsError as exc:
                if exc.code == errno.EIO:
                    self.repairs.schedule(target, chunk)
                raise
        meta: ChunkMeta = {
            "version": rec.version,
            "length": rec.length,
            "chunk_size": rec.chunk_size,
        }
        return Reply(meta, data)
