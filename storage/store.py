"""`ChunkStore`: a target's chunks behind a synchronous API, reads and listing
on top of the update protocol (`staging.py`) and the target format
(`target.py`).

Every method may block on disk I/O; the storage service calls them from
worker threads, except `read_nowait`, which never blocks and runs on the
event loop (a page-cache hit costs no thread round trip).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.heap import uninitialized
from shufflefs.storage.cache import FdHandle, Missing
from shufflefs.storage.crc import first_bad_block
from shufflefs.storage.layout import (
    MAX_CHUNK_SIZE,
    ChunkRecord,
    block_span,
    check_chunk_id,
    same_record,
)
from shufflefs.storage.protocol import ChunkInfo, ChunkPage
from shufflefs.storage.staging import WritableTarget

log = logging.getLogger("shufflefs.storage.store")

READ_RETRIES = 8  # a read that keeps meeting concurrent updates gives up with EAGAIN
NOWAIT_MAX = 256 << 10  # larger reads always go to a thread (CRC time on the event loop)
LIST_MAX = 10000  # chunks per list_chunks page
LIST_CRC_BUDGET = 512 << 10  # checksum bytes per page: the reply must fit one frame body
EMPTY = memoryview(b"")


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """A verified read in two halves (`ChunkStore.read_plan`, `finish_read`),
    for a read that waits for the disk through io_uring (storage/uring.py,
    storage/uring_threads.py)."""

    rec: ChunkRecord
    handle: FdHandle | None  # held until finish_read; None: the file is to be opened
    first: int  # the first block's index
    start: int  # the aligned range to read: [start, stop) of the chunk file
    stop: int
    lo: int  # the bytes asked for: [lo, hi) of that range
    hi: int
    cid: bytes = b""  # (a file to open) the chunk,
    path: str = ""  # its file,
    epoch: int = 0  # and the fd cache's epoch noted before the open

    @property
    def source(self) -> int | str:
        """What the ring reads: the held fd, or the path to open."""
        return self.path if self.handle is None else self.handle.fd


def _check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > MAX_CHUNK_SIZE:
        raise FsError(
            errno.EINVAL,
            f"bad range offset={offset} length={length} (chunk size <= {MAX_CHUNK_SIZE})",
        )


class ChunkStore(WritableTarget):
    """One target: its format and recovery (`Target`), its updates
    (`WritableTarget`), and here what reads it: verified range reads,
    whole-chunk reads for copies between replicas, and listing.

    Readers take no lock: what they read is validated against the record (a
    checksum mismatch or a short read is re-checked against the current
    record, and retried if the chunk changed under them)."""

    # ---- reads -----------------------------------------------------------

    def read(self, cid: bytes, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset+length) of a chunk, verified. Short past the
        committed length; empty for a chunk that does not exist. A block
        whose checksum fails is never returned: EIO, logged as an error."""
        check_chunk_id(cid)
        _check_range(offset, length)
        bs = self.block_size
        for _ in range(READ_RETRIES):
            rec = self._record(cid)
            if rec is None:
                return EMPTY
            if offset + length > rec.chunk_size:
                raise FsError(
                    errno.EINVAL,
                    f"range {offset}+{length} passes the chunk size {rec.chunk_size}",
                )
            span = block_span(offset, length, rec.length, bs)
            if span is None:
                return EMPTY
            first, start, stop, end = span
            try:
                handle = self._acquire_fd(cid, rec.generation)
            except FileNotFoundError:
                bad, problem = first, "chunk file missing"
            else:
                try:
                    data = os.pread(handle.fd, stop - start, start)
                finally:
                    self._fds.release(handle)
                if len(data) != stop - start:
                    bad, problem = (start + len(data)) // bs, "chunk file shorter than committed"
                else:
                    bad = first_bad_block(data, first, rec.crcs, bs)
                    if bad < 0:
                        return memoryview(data)[offset - start : end - start]
                    problem = "checksum mismatch"
            if self._changed_since(cid, rec):
                continue  # raced with an update: read the new state
            raise self._corrupt(cid, rec, bad, problem)
        raise FsError(errno.EAGAIN, f"chunk {cid.hex()} kept changing during the read")

    def read_nowait(
        self, cid: bytes, offset: int, length: int, loading: bool = False
    ) -> memoryview | None:
        """`read` if it can be done without blocking (record cached, file
        held or its path in the kernel's caches, data in the page cache:
        preadv2 with RWF_NOWAIT); None otherwise, and for anything unusual,
        which `read` then handles in a thread. The hottest call of a daemon
        (every page-cache read): no plan object. *loading* (a thread, never
        the event loop): a record not cached is read from the records'
        database (its pages may wait for the disk)."""
        if not self._nowait:
            check_chunk_id(cid)
            _check_range(offset, length)
            return None
        span = self._cached_span(cid, offset, length, NOWAIT_MAX, loading)
        if span is None or isinstance(span, memoryview):
            return span
        rec, handle, first, start, stop, end = span
        if handle is None:  # (the first try at a read: `read_plan` follows one)
            handle = self._open_cached(cid, rec.generation)
            if handle is None:
                return None
        n = stop - start
        buf = uninitialized(n)
        got = -1
        try:
            got = os.preadv(handle.fd, [buf], start, os.RWF_NOWAIT)
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False
                log.info("target=%s: RWF_NOWAIT unsupported, reads use threads", self.label)
        finally:
            self._fds.release(handle)
        return self._verified(buf, rec, first, n, offset - start, end - start) if got == n else None

    def read_plan(
        self,
        cid: bytes,
        offset: int,
        length: int,
        limit: int = MAX_CHUNK_SIZE,
        loading: bool = False,
        opening: bool = False,
    ) -> ReadPlan | memoryview | None:
        """What a read of [offset, offset+length) takes, if its record and
        file are cached (nothing here blocks): the aligned range to read and
        the fd, held until `finish_read`; or the answer itself (empty); or
        None when `read` must do it in a thread (not cached, more than
        *limit* bytes). *loading* (off the event loop): a record not cached
        is read. *opening*: a file not held is planned to be opened through
        io_uring (`ReadPlan.path`, the fd given to `finish_read`)."""
        span = self._cached_span(cid, offset, length, limit, loading)
        if span is None or isinstance(span, memoryview):
            return span
        rec, handle, first, start, stop, end = span
        if handle is not None:
            return ReadPlan(rec, handle, first, start, stop, offset - start, end - start)
        if not opening:
            return None
        lo, hi, path = offset - start, end - start, self._path(cid, rec.generation)
        return ReadPlan(rec, None, first, start, stop, lo, hi, cid, path, self._fds.epoch)

    def _cached_span(
        self, cid: bytes, offset: int, length: int, limit: int, loading: bool = False
    ) -> tuple[ChunkRecord, FdHandle | None, int, int, int, int] | memoryview | None:
        """`read_plan` as a plain tuple (record, referenced fd handle or None
        if the file is not held, first block, aligned start, aligned stop,
        end of the bytes asked for); *loading*: see `read_nowait`."""
        check_chunk_id(cid)
        _check_range(offset, length)
        if loading:
            rec = self._record(cid)
            if rec is None:
                return EMPTY
        else:
            cached = self._records.get(cid)
            if cached is None:
                return None
            if isinstance(cached, Missing):
                return EMPTY
            rec = cached
        if offset + length > rec.chunk_size:
            raise FsError(
                errno.EINVAL, f"range {offset}+{length} passes the chunk size {rec.chunk_size}"
            )
        span = block_span(offset, length, rec.length, self.block_size)
        if span is None:
            return EMPTY
        first, start, stop, end = span
        if stop - start > limit:
            return None
        return rec, self._fds.get((cid, rec.generation)), first, start, stop, end

    def finish_read(
        self, plan: ReadPlan, data: bytearray | None, opened: int | None = None
    ) -> memoryview | None:
        """Give back the plan's fd, or keep the one *opened* for it (cached
        unless its file changed since the plan); the bytes asked for if
        *data* (the aligned range read) is whole and every block checks,
        else None: `read` then reads again in a thread (and reports a
        damaged block as EIO)."""
        if plan.handle is not None:
            self._fds.release(plan.handle)
        elif opened is not None:
            key = (plan.cid, plan.rec.generation)
            self._fds.release(self._fds.put(key, opened, plan.epoch))
        if data is None:
            return None
        return self._verified(data, plan.rec, plan.first, plan.stop - plan.start, plan.lo, plan.hi)

    def _verified(
        self, data: bytearray, rec: ChunkRecord, first: int, n: int, lo: int, hi: int
    ) -> memoryview | None:
        """Bytes [lo, hi) of *data*, the aligned range read from block *first*
        on, if it is whole (*n* bytes) and every block checks; else None."""
        if len(data) != n or first_bad_block(data, first, rec.crcs, self.block_size) >= 0:
            return None
        return memoryview(data)[lo:hi]

    # ---- inspection ------------------------------------------------------

    def _info(self, cid: bytes, rec: ChunkRecord) -> ChunkInfo:
        return {
            "chunk": cid,
            "version": rec.version,
            "length": rec.length,
            "block_size": self.block_size,
            "crcs": rec.crc_bytes(),
        }

    def chunk_info(self, cid: bytes) -> ChunkInfo:
        check_chunk_id(cid)
        rec = self._record(cid)
        if rec is None:
            raise FsError(errno.ENOENT, f"no chunk {cid.hex()} on target {self.label}")
        return self._info(cid, rec)

    def read_full(self, cid: bytes) -> tuple[ChunkRecord, bytes]:
        """The whole committed chunk and the record it belongs to, every block
        verified (EIO on damage, ENOENT if the chunk does not exist): what a
        replica sends when another one copies the chunk."""
        check_chunk_id(cid)
        for _ in range(READ_RETRIES):
            rec = self._record(cid)
            if rec is None:
                raise FsError(errno.ENOENT, f"no chunk {cid.hex()} on target {self.label}")
            data = bytes(self.read(cid, 0, rec.chunk_size))
            if len(data) == rec.length and same_record(self._record(cid), rec):
                return rec, data
        raise FsError(errno.EAGAIN, f"chunk {cid.hex()} kept changing during the read")

    def verify(self, cid: bytes) -> str | None:
        """Check every block of a committed chunk against its checksums;
        None if it is intact (or gone), else what is wrong (scrub)."""
        try:
            self.read_full(cid)
        except FsError as exc:
            if exc.code == errno.ENOENT:
                return None
            if exc.code == errno.EIO:
                return exc.message
            raise
        return None

    def list_range(self, after: bytes | None, until: bytes | None) -> dict[bytes, ChunkInfo]:
        """Every chunk with after < id <= until (None: unbounded), by id."""
        out: dict[bytes, ChunkInfo] = {}
        while True:
            page = self.list_chunks(after, LIST_MAX, until)
            for info in page["chunks"]:
                out[info["chunk"]] = info
            if not page["more"] or not page["chunks"]:
                return out
            after = page["chunks"][-1]["chunk"]

    def list_chunks(
        self, after: bytes | None = None, limit: int = 1000, until: bytes | None = None
    ) -> ChunkPage:
        """A page of chunks in id order, starting after *after* and ending
        at *until* (None: unbounded; a chunk past it is not decoded: resync
        and scrub ask for one source page's range of ids, ~500 chunks, and
        decoding a whole page of ten thousand each time made a restarted
        target's resync cost twenty times the CPU). Pages are also cut by
        checksum bytes so that a reply fits one frame."""
        if after is not None:
            check_chunk_id(after)
        if limit < 1:
            raise FsError(errno.EINVAL, f"limit {limit} must be positive")
        limit = min(limit, LIST_MAX)
        chunks: list[ChunkInfo] = []
        budget = LIST_CRC_BUDGET
        more = False
        with self.env.begin(db=self.db_chunks) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(after or b""):
                return {"chunks": chunks, "more": False}
            for key, raw in cursor:
                if after is not None and key <= after:
                    continue
                if until is not None and key > until:
                    break
                if len(chunks) >= limit or budget <= 0:
                    more = True
                    break
                try:
                    rec = ChunkRecord.decode(raw, self.block_size)
                except FsError as exc:
                    log.error(
                        "corrupt record target=%s chunk=%s: %s", self.label, key.hex(), exc.message
                    )
                    continue
                chunks.append(self._info(bytes(key), rec))
                budget -= 4 * len(rec.crcs) + 64
        return {"chunks": chunks, "more": more}
