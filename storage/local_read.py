"""Short-circuit reads: a client on a storage node's own host reads the chunk
files of that node's targets directly, with the checksums still verified.

A read through the storage daemon costs two process switches and a trip
through its event loop; on the same host the bytes are one `pread` away. The
client opens the target's chunk table read-only (LMDB allows any number of
reader processes beside the daemon that writes it), looks up the committed
record of the chunk in a short read transaction, preads the blocks the range
touches from the record's generation file and checks their CRC-32C. Only the
committed state is read, so it is exactly what the daemon would return.

Anything unusual answers None and the caller reads through the daemon: a
record or file that changed under us (a copy-on-write unlinks the old
generation), a checksum mismatch (the daemon repairs; we never report from
here), a database that grew its map, a target that is not what the routing
map says (another machine that happens to share the host name).

This module belongs to storage's public surface: it is the one place outside
the daemon that knows the on-disk format.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import lmdb

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import read_json
from shufflefs.rpc.heap import uninitialized
from shufflefs.storage.cache import FdCache, FdHandle, Missing, RecordCache, fd_share
from shufflefs.storage.cached_open import open_cached
from shufflefs.storage.crc import first_bad_block
from shufflefs.storage.layout import (
    CHUNKS_DIR,
    META_DIR,
    TARGET_FILE,
    ChunkRecord,
    block_span,
    chunk_dir_name,
    chunk_file_name,
)

log = logging.getLogger("shufflefs.storage.local_read")

EMPTY = memoryview(b"")
MAX_FDS = 4096  # open chunk files per target, if the process's fd limit allows
MAX_RECORDS = 1 << 18


def _file_of(key: tuple[bytes, int]) -> bytes:
    return key[0][:8]  # a chunk id starts with its file's inode


def _file_of_chunk(cid: bytes) -> bytes:
    return cid[:8]


def fd_budget(targets: int = 4) -> int:
    """How many chunk files one target may keep open: MAX_FDS, or what the
    open-file limit leaves (raised first, as the daemons do) for this many
    targets and the rest of the process: together at most half of it."""
    return fd_share(MAX_FDS, targets, kept=0.5, at_least=512)


@dataclass(eq=False)
class LocalPlan:
    """A chunk read planned by `LocalTarget.plan`: the file to read and where
    its blocks land; `LocalTarget.finish` checks them."""

    cid: bytes
    rec: ChunkRecord
    handle: FdHandle | None  # None until `LocalTarget.opened` (`plan_cold`)
    buf: bytearray | memoryview  # the whole blocks of the range
    first: int  # the first block's index
    start: int  # the first block's offset in the chunk file
    lo: int  # where the asked range starts in *buf*
    hi: int  # and ends
    path: str = ""  # the chunk file to open, when *handle* is None
    epoch: int = 0  # of the fd cache, noted before *path* is opened


class LocalTarget:
    """Read-only access to one target directory on this host."""

    def __init__(
        self, path: str | Path, target_id: int, cluster_id: str, host_targets: int = 4
    ) -> None:
        """*host_targets*: how many targets this host has (they share the
        process's open-file limit: `fd_budget`)."""
        self.path = Path(path)
        info = read_json(self.path / TARGET_FILE)
        if info.get("target_id") != target_id or info.get("cluster_id") != cluster_id:
            raise FsError(errno.ESTALE, f"{self.path} is not target {target_id} of this cluster")
        self.target_id = target_id
        self.block_size: int = info["block_size"]
        self.env = lmdb.open(
            str(self.path / META_DIR), readonly=True, max_dbs=2, subdir=True, readahead=False
        )
        self.db = self.env.open_db(b"chunks", create=False)
        # Open chunk files, least recently used first, grouped per file so
        # that forgetting a file closes its chunks (an fd held after the
        # daemon removed a chunk would keep its space from being freed).
        self._fds: FdCache[tuple[bytes, int]] = FdCache(fd_budget(host_targets), group=_file_of)
        # Committed records read before, per file, reused until the caller
        # says the file may have changed (`forget`): close-to-open, as the
        # kernel caches data. Without it every read of cold data would also
        # fault in chunk-table pages from disk.
        self._records: RecordCache[bytes, ChunkRecord] = RecordCache(
            MAX_RECORDS, group=_file_of_chunk
        )
        self._chunks = str(self.path / CHUNKS_DIR)

    def close(self) -> None:
        self._fds.close_all()
        self.env.close()

    def _record(self, cid: bytes) -> ChunkRecord | None:
        cached = self._records.get(cid)
        if cached is not None and not isinstance(cached, Missing):
            return cached
        epoch = self._records.epoch
        with self.env.begin(db=self.db, buffers=True) as txn:
            raw = txn.get(cid)
            rec = None if raw is None else ChunkRecord.decode(raw, self.block_size)
        if rec is not None:  # an absent chunk is not remembered: it may be written next
            self._records.fill(cid, rec, epoch)
        return rec

    def forget(self, cids: Iterable[bytes] | None = None) -> None:
        """Drop what is cached of the files of *cids* (or of all files):
        the caller knows they may have changed (opened again, written,
        closed). That closes their chunk files too: a cached fd keeps a chunk
        the daemon removed (or replaced by copy-on-write) on disk."""
        if cids is None:
            self._records.clear()
            self._fds.close_all()
            return
        for prefix in {cid[:8] for cid in cids}:
            self._forget_prefix(prefix)

    def forget_file(self, ino: int) -> None:
        """`forget` every chunk of one file."""
        self._forget_prefix(ino.to_bytes(8, "big"))

    def close_file(self, ino: int) -> None:
        """A file is no longer open here: close its chunk files (a removed
        chunk's space must come back once the daemon deletes it). Its
        records stay: they are forgotten when an open shows a change
        (`forget_file`), and reused by the next read of the unchanged file."""
        self._fds.close_group(ino.to_bytes(8, "big"))

    def _drop_chunk(self, cid: bytes, key: tuple[bytes, int]) -> None:
        """One chunk's record and file are suspect: look both up again."""
        self._records.invalidate(cid)
        self._fds.invalidate(key)

    def _forget_prefix(self, prefix: bytes) -> None:
        self._records.invalidate_group(prefix)
        self._fds.invalidate_group(prefix)

    def _open(self, cid: bytes, generation: int, nowait: bool) -> FdHandle | None:
        """A referenced handle on a chunk file (release it after use); None
        if it is gone (the daemon answers) or, with *nowait*, not open yet
        and not to be opened without waiting for the disk (its path not in
        the dentry cache: storage/cached_open.py)."""
        key = (cid, generation)
        handle = self._fds.get(key)
        if handle is not None:
            return handle
        epoch = self._fds.epoch
        path = self._chunk_path(cid, generation)
        try:
            fd = open_cached(path, os.O_RDONLY) if nowait else os.open(path, os.O_RDONLY)
        except OSError:  # the generation was replaced (copy-on-write): ask the daemon
            self._drop_chunk(cid, key)
            return None
        return None if fd is None else self._fds.put(key, fd, epoch)

    def _chunk_path(self, cid: bytes, generation: int) -> str:
        return f"{self._chunks}/{chunk_dir_name(cid)}/{chunk_file_name(cid, generation)}"

    def read(
        self,
        cid: bytes,
        offset: int,
        length: int,
        nowait: bool,
        into: memoryview | None = None,
    ) -> memoryview | None:
        """The committed bytes of [offset, offset + length) of a chunk (short
        past its end, empty if it does not exist); None if the daemon must
        answer, or, with *nowait*, if the bytes are not in the page cache or
        the chunk file is neither open nor in the dentry cache. With *into*
        (bytes, at least *length* long) a range that starts and ends where
        the checksummed blocks do (a whole chunk or file: most reads of
        samples) is read straight into it, and the result is a view of it
        (one copy of the bytes less; *into* may hold anything after a None)."""
        plan = self.plan(cid, offset, length, nowait, into)
        if not isinstance(plan, LocalPlan):
            return plan
        handle = plan.handle
        assert handle is not None  # (opened by `plan`)
        try:
            got: int | OSError = os.preadv(
                handle.fd, [plan.buf], plan.start, os.RWF_NOWAIT if nowait else 0
            )
        except BlockingIOError:
            self._fds.release(handle)
            return None
        except OSError as exc:
            got = exc
        if isinstance(got, int) and got != len(plan.buf) and nowait:
            self._fds.release(handle)  # partly in the page cache: a thread reads it all
            return None
        return self.finish(plan, got)

    def read_ahead(self, cid: bytes, offset: int, length: int) -> None:
        """Start reading the blocks `read` of the same range would read into
        the page cache, without waiting for them (POSIX_FADV_WILLNEED);
        nothing if the chunk is not readable here (`read` will say)."""
        located = self._located(cid, offset, length)
        if not isinstance(located, tuple):
            return
        rec, (_, start, stop, _) = located
        handle = self._open(cid, rec.generation, nowait=False)
        if handle is None:
            return
        try:
            with contextlib.suppress(OSError):  # advice: `read` reports what fails
                os.posix_fadvise(handle.fd, start, stop - start, os.POSIX_FADV_WILLNEED)
        finally:
            self._fds.release(handle)

    def plan(
        self, cid: bytes, offset: int, length: int, nowait: bool, into: memoryview | None = None
    ) -> LocalPlan | memoryview | None:
        """What `read` reads, before it reads: the chunk file (opened here;
        with *nowait* only from the dentry cache; released by `finish`) and
        the blocks to read; or the
        answer already (empty, or None: the daemon's to answer)."""
        located = self._located(cid, offset, length)
        if not isinstance(located, tuple):
            return located
        rec, (first, start, stop, end) = located
        n = stop - start
        buf: bytearray | memoryview
        if into is not None and start == offset and stop == end and len(into) >= n:
            buf = into[:n]
        else:
            buf = uninitialized(n)
        handle = self._open(cid, rec.generation, nowait)
        if handle is None:
            return None
        return LocalPlan(cid, rec, handle, buf, first, start, offset - start, end - start)

    def plan_cold(self, cid: bytes, offset: int, length: int) -> LocalPlan | memoryview | None:
        """`plan` for a read whose chunk file, if it is not open here yet, is
        opened elsewhere (io_uring: `open_and_read`), so that this thread
        does not wait for the disk's lookup of it: the plan's *handle* is the
        cached fd's, or None with the file's *path* (`opened` then adopts
        the fd). The blocks land in a buffer of their own."""
        located = self._located(cid, offset, length)
        if not isinstance(located, tuple):
            return located
        rec, (first, start, stop, end) = located
        epoch = self._fds.epoch
        handle = self._fds.get((cid, rec.generation))
        path = "" if handle is not None else self._chunk_path(cid, rec.generation)
        buf = uninitialized(stop - start)
        return LocalPlan(
            cid, rec, handle, buf, first, start, offset - start, end - start, path, epoch
        )

    def opened(self, plan: LocalPlan, fd: int | OSError) -> bool:
        """*plan*'s chunk file, opened elsewhere: *fd* (now this target's, in
        its cache unless something was invalidated since the plan) or the
        open's error (False: gone, replaced by copy-on-write; the daemon
        answers)."""
        key = (plan.cid, plan.rec.generation)
        if isinstance(fd, OSError):
            self._drop_chunk(plan.cid, key)
            return False
        plan.handle = self._fds.put(key, fd, plan.epoch)
        return True

    def _located(
        self, cid: bytes, offset: int, length: int
    ) -> tuple[ChunkRecord, tuple[int, int, int, int]] | memoryview | None:
        """The chunk's committed record and the blocks a read of the range
        takes (`block_span`); or the answer already: EMPTY (nothing there),
        None (the chunk table is unreadable here: the daemon's to answer)."""
        try:
            rec = self._record(cid)
        except (lmdb.Error, FsError) as exc:
            log.debug("target=%d: chunk table unreadable here: %s", self.target_id, exc)
            return None
        if rec is None:
            return EMPTY
        span = block_span(offset, length, rec.length, self.block_size)
        return EMPTY if span is None else (rec, span)

    def finish(self, plan: LocalPlan, got: int | OSError) -> memoryview | None:
        """`plan`'s bytes once read (*got*: how many, or the read's error):
        verified, or None (changed under us, damaged: the daemon decides)."""
        if plan.handle is not None:
            self._fds.release(plan.handle)
        key = (plan.cid, plan.rec.generation)
        if isinstance(got, OSError):
            self._drop_chunk(plan.cid, key)
            return None
        buf = plan.buf
        if got != len(buf) or first_bad_block(buf, plan.first, plan.rec.crcs, self.block_size) >= 0:
            self._drop_chunk(plan.cid, key)
            return None
        return memoryview(buf)[plan.lo : plan.hi]  # (in place: all of *into*'s view)
