"""`ChunkStore`: the chunks of one target directory, behind a synchronous API.

Every method may block on disk I/O; the server calls them from worker threads
(`read_nowait` is the one exception: it never blocks and may run on the event
loop). The on-disk layout is described in `shufflefs.storage.layout` and
docs/storage.md; this module holds the write/commit protocol that keeps a
chunk crash safe:

* an **append** (a write at or past the committed length) goes in place:
  cut the file back to the committed length, pwrite, fdatasync, then commit
  the new length and the checksums of the touched blocks in one LMDB
  transaction. Until that commit the new bytes lie past the committed length,
  which is never trusted.
* a write that **changes committed bytes** is copy-on-write: the new chunk is
  built in a file of a new generation (old bytes + new), fsynced, the record
  is switched to it in one transaction, then the old file is unlinked.
* **truncate** commits the shorter record first, then cuts the file;
  **remove** deletes the record first, then the file.
* at open, files whose generation is not the committed one are deleted
  (they are the remains of a write or a removal that a crash interrupted).

A write is two steps, so that chain replication can make an update durable
on every replica before any replica shows it: `stage_write` (or
`stage_replace`, whole-chunk content from another replica) does all the
disk work above except the LMDB commit and returns a `Staged`; `commit`
is the one transaction that makes it visible, `abort` removes it. A staged
update is invisible to readers (they read committed records only) and
leaves no trace after an abort or a crash. `write` is stage + commit.

So after a crash at any instant each chunk is, whole, either as before or as
after the write in flight, and its checksums match.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import struct
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import fsync_dir, read_json, write_json_durably
from shufflefs.storage.cache import MISSING, FdCache, FdHandle, Missing, RecordCache
from shufflefs.storage.crc import (
    CRC_TYPECODE,
    block_crcs,
    crc32c,
    first_bad_block,
    zero_block_crc,
)
from shufflefs.storage.layout import (
    CHUNKS_DIR,
    FORMAT_VERSION,
    MAX_CHUNK_SIZE,
    META_DIR,
    RECORD_HEADER,
    TARGET_FILE,
    ChunkRecord,
    block_count,
    block_span,
    check_block_size,
    check_chunk_id,
    check_chunk_size,
    chunk_dir_name,
    chunk_file_name,
    parse_chunk_file_name,
)
from shufflefs.storage.protocol import (
    NEED_FULL,
    ChunkInfo,
    ChunkPage,
    TargetStats,
    WriteResult,
)

log = logging.getLogger("shufflefs.storage.chunks")

Data = bytes | bytearray | memoryview

LOCK_STRIPES = 1024  # chunk locks: writers to one chunk are serialized, readers take none
BATCH = 512  # chunks per transaction in truncate_file / remove_file
READ_RETRIES = 8  # a read that keeps meeting concurrent updates gives up with EAGAIN
NOWAIT_MAX = 256 << 10  # larger reads always go to a thread (CRC time on the event loop)
LIST_MAX = 10000  # chunks per list_chunks page
LIST_CRC_BUDGET = 512 << 10  # checksum bytes per page: the reply must fit one frame body
DEFAULT_MAP_SIZE = 256 << 30  # LMDB address space (virtual; the file grows as needed)
COPY_PIECE = 8 << 20
EMPTY = memoryview(b"")

STATS_USED = b"used"
STATS_CHUNKS = b"chunks"
U64 = struct.Struct(">Q")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _pwrite_all(fd: int, data: Data, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy [offset, offset+length) between files at the same offsets, in
    the kernel where it can (copy_file_range may even share extents)."""
    end = offset + length
    pos = offset
    try:
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n == 0:
                raise FsError(errno.EIO, f"chunk file ends at {pos}, expected {end} bytes")
            pos += n
        return
    except OSError as exc:
        if isinstance(exc, FsError) or exc.errno not in (
            errno.EXDEV,
            errno.ENOSYS,
            errno.EOPNOTSUPP,
            errno.EINVAL,
        ):
            raise
    while pos < end:
        piece = os.pread(src, min(COPY_PIECE, end - pos), pos)
        if not piece:
            raise FsError(errno.EIO, f"chunk file ends at {pos}, expected {end} bytes")
        _pwrite_all(dst, piece, pos)
        pos += len(piece)


# What a staged update does on disk (and so how commit and abort finish it).
NOOP = "noop"  # a zero-length write: nothing at all
APPEND = "append"  # bytes written in place past the committed length of the chunk's file
CREATE = "create"  # a new chunk: a new file
COW = "cow"  # an overwrite: a new generation file holding the whole new chunk
REPLACE = "replace"  # whole-chunk content from another replica: a new generation file


@dataclass(eq=False)
class Staged:
    """An update that is durable on disk but not committed: readers see the
    committed record only, so they never see it. `ChunkStore.commit` makes it
    visible in one LMDB transaction; `ChunkStore.abort` removes it. The
    caller serializes updates of one chunk from stage to commit (the storage
    service holds the chunk's lock); commit refuses an update whose base is
    no longer the committed record."""

    cid: bytes
    kind: str
    base: ChunkRecord | None  # the committed record the update was built on
    new: ChunkRecord | None  # the record commit installs (None: a zero-length write)
    fd: int = -1  # the new file (CREATE, COW, REPLACE), owned until commit or abort
    handle: FdHandle | None = None  # the committed file appended to (APPEND)
    d_used: int = 0
    d_chunks: bool = False
    done: bool = False

    @property
    def version(self) -> int:
        """The version this update produces."""
        if self.new is not None:
            return self.new.version
        return self.base.version if self.base is not None else 0

    @property
    def base_version(self) -> int:
        return self.base.version if self.base is not None else 0


def _same_record(a: ChunkRecord | None, b: ChunkRecord | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.version, a.generation, a.length) == (b.version, b.generation, b.length)


def _check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > MAX_CHUNK_SIZE:
        raise FsError(
            errno.EINVAL,
            f"bad range offset={offset} length={length} (chunk size <= {MAX_CHUNK_SIZE})",
        )


def _check_ino(ino: int) -> None:
    if not 0 <= ino < 1 << 64:
        raise FsError(errno.EINVAL, f"inode {ino} out of range")


class ChunkStore:
    """One target directory: chunk files plus an LMDB env of chunk records.

    Thread safe: any number of readers and writers may call in concurrently.
    Writers to one chunk are serialized by a striped lock; readers take no
    lock and instead validate what they read (a checksum mismatch or a short
    read is re-checked against the current record, and retried if the chunk
    changed under them)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        block_size: int = 4096,
        fsync: bool = True,
        reserve_bytes: int = 16 << 20,
        fd_cache: int = 1024,
        record_cache: int = 65536,
        map_size: int = DEFAULT_MAP_SIZE,
        max_readers: int = 256,
    ) -> None:
        self.path = Path(path).absolute()
        self.fsync = fsync
        self.reserve_bytes = max(0, reserve_bytes)
        info = self._open_or_format(block_size)
        self.block_size: int = info["block_size"]
        self.target_id: int | None = info.get("target_id")
        self.cluster_id: str | None = info.get("cluster_id")
        self._chunks_root = str(self.path / CHUNKS_DIR)
        self.device = os.stat(self.path).st_dev  # targets on one filesystem share its space
        fresh_meta = not (self.path / META_DIR / "data.mdb").exists()
        if fresh_meta and self._has_chunk_files():
            raise FsError(
                errno.EIO,
                f"target {self.path} holds chunk files but its {META_DIR}/ database is "
                "missing: refusing to start (recovery would delete every chunk)",
            )
        self.env = lmdb.open(
            str(self.path / META_DIR),
            map_size=map_size,
            max_dbs=2,
            max_readers=max_readers,
            sync=fsync,
            metasync=fsync,
            readahead=False,  # random access to a db that may exceed RAM
        )
        try:
            self.db_chunks = self.env.open_db(b"chunks")
            self.db_stats = self.env.open_db(b"stats")
            self._records: RecordCache[bytes, ChunkRecord] = RecordCache(record_cache)
            self._fds: FdCache[tuple[bytes, int]] = FdCache(fd_cache)
            self._locks = [threading.Lock() for _ in range(LOCK_STRIPES)]
            self._commit_lock = threading.Lock()
            self._nowait = hasattr(os, "RWF_NOWAIT")
            self.used = 0
            self.chunks = 0
            self._next_gen = itertools.count(1)
            self._recover()
        except BaseException:
            self.env.close()
            raise

    # ---- identity and opening -------------------------------------------

    @property
    def label(self) -> str:
        """How logs name this target: its id once mgmtd assigned one."""
        return str(self.target_id) if self.target_id is not None else str(self.path)

    def _open_or_format(self, block_size: int) -> dict[str, Any]:
        target_file = self.path / TARGET_FILE
        if target_file.exists():
            info = read_json(target_file)
            if info.get("format") != FORMAT_VERSION:
                raise FsError(
                    errno.EINVAL,
                    f"target {self.path}: format {info.get('format')!r} is not {FORMAT_VERSION}",
                )
            try:
                check_block_size(info.get("block_size", 0))
            except FsError:
                raise FsError(errno.EIO, f"{target_file}: bad block_size") from None
        else:
            check_block_size(block_size)
            if self.path.exists():
                stray = [
                    e
                    for e in os.listdir(self.path)
                    if e != "lost+found" and not e.startswith(TARGET_FILE)
                ]
                if stray:
                    raise FsError(
                        errno.EINVAL,
                        f"{self.path} is not empty and has no {TARGET_FILE}: "
                        "refusing to format it as a storage target",
                    )
            self.path.mkdir(parents=True, exist_ok=True)
            info = {
                "format": FORMAT_VERSION,
                "block_size": block_size,
                "target_id": None,
                "cluster_id": None,
            }
            write_json_durably(target_file, info, self.fsync)
            log.info("formatted target path=%s block_size=%d", self.path, block_size)
        # created on every open: a crash during formatting leaves target.json only
        for i in range(256):
            (self.path / CHUNKS_DIR / f"{i:02x}").mkdir(parents=True, exist_ok=True)
        return info

    def _has_chunk_files(self) -> bool:
        for i in range(256):
            with os.scandir(os.path.join(self._chunks_root, f"{i:02x}")) as entries:
                if any(True for _ in entries):
                    return True
        return False

    def set_identity(self, target_id: int, cluster_id: str) -> None:
        """Persist the id mgmtd assigned (once: a different id later is refused)."""
        if self.target_id == target_id and self.cluster_id == cluster_id:
            return
        if self.target_id is not None and self.target_id != target_id:
            raise FsError(
                errno.EINVAL,
                f"target {self.path} is target {self.target_id}, mgmtd calls it {target_id}",
            )
        if self.cluster_id is not None and self.cluster_id != cluster_id:
            raise FsError(
                errno.EINVAL,
                f"target {self.path} belongs to cluster {self.cluster_id}, not {cluster_id}",
            )
        target_file = self.path / TARGET_FILE
        info = read_json(target_file)
        info.update(target_id=target_id, cluster_id=cluster_id)
        write_json_durably(target_file, info, self.fsync)
        self.target_id, self.cluster_id = target_id, cluster_id
        log.info("target path=%s is target=%d cluster=%s", self.path, target_id, cluster_id)

    def _recover(self) -> None:
        """Startup: delete chunk files that are not the committed generation,
        report committed chunks whose file is gone, recount the counters."""
        count = used = max_gen = 0
        with self.env.begin() as txn:
            for _, raw in txn.cursor(db=self.db_chunks):
                if len(raw) < RECORD_HEADER.size:
                    continue
                _, _, gen, length, _ = RECORD_HEADER.unpack_from(raw)
                count += 1
                used += length
                max_gen = max(max_gen, gen)
            stored = [txn.get(k, db=self.db_stats) for k in (STATS_USED, STATS_CHUNKS)]
            present = removed = 0
            for i in range(256):
                sub = os.path.join(self._chunks_root, f"{i:02x}")
                with os.scandir(sub) as entries:
                    for entry in entries:
                        parsed = parse_chunk_file_name(entry.name)
                        if parsed is None:
                            log.warning("unknown file in target=%s: %s", self.label, entry.path)
                            continue
                        cid, gen = parsed
                        max_gen = max(max_gen, gen)
                        committed = txn.get(cid, db=self.db_chunks)
                        if (
                            committed is not None
                            and len(committed) >= RECORD_HEADER.size
                            and RECORD_HEADER.unpack_from(committed)[2] == gen
                        ):
                            present += 1
                            continue
                        os.unlink(entry.path)
                        removed += 1
            if present != count:  # rare: only then look for the ones without a file
                missing = []
                for key, raw in txn.cursor(db=self.db_chunks):
                    gen = RECORD_HEADER.unpack_from(raw)[2] if len(raw) >= RECORD_HEADER.size else 0
                    if not os.path.exists(self._path(key, gen)):
                        missing.append(key.hex())
                log.error(
                    "target=%s has %d committed chunks without a file (reads of them fail "
                    "with EIO): %s",
                    self.label,
                    len(missing),
                    " ".join(missing[:20]),
                )
        if stored != [U64.pack(used), U64.pack(count)]:
            if stored != [None, None]:
                log.warning("target=%s counters were off; recounted", self.label)
            with self._commit_lock, self.env.begin(write=True) as wtxn:
                wtxn.put(STATS_USED, U64.pack(used), db=self.db_stats)
                wtxn.put(STATS_CHUNKS, U64.pack(count), db=self.db_stats)
        self.used, self.chunks = used, count
        self._next_gen = itertools.count(max_gen + 1)
        log.info(
            "opened target=%s path=%s chunks=%d used=%d stray_files_removed=%d",
            self.label,
            self.path,
            count,
            used,
            removed,
        )

    def close(self) -> None:
        self._fds.close_all()
        self.env.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records, files, locks -----------------------------------------

    def _path(self, cid: bytes, generation: int) -> str:
        return f"{self._chunks_root}/{chunk_dir_name(cid)}/{chunk_file_name(cid, generation)}"

    def file_path(self, cid: bytes) -> str | None:
        """The committed file of a chunk (for tests and tools)."""
        rec = self._record(cid)
        return None if rec is None else self._path(cid, rec.generation)

    def _load(self, cid: bytes) -> ChunkRecord | None:
        with self.env.begin(db=self.db_chunks) as txn:
            raw = txn.get(cid)
        if raw is None:
            return None
        try:
            return ChunkRecord.decode(raw, self.block_size)
        except FsError as exc:
            log.error("corrupt record target=%s chunk=%s: %s", self.label, cid.hex(), exc.message)
            raise

    def _record(self, cid: bytes) -> ChunkRecord | None:
        cached = self._records.get(cid)
        if cached is not None:
            return None if isinstance(cached, Missing) else cached
        epoch = self._records.epoch
        rec = self._load(cid)
        self._records.fill(cid, MISSING if rec is None else rec, epoch)
        return rec

    def _changed_since(self, cid: bytes, rec: ChunkRecord) -> bool:
        """Did the chunk change after *rec* was read? (Refreshes the cache.)"""
        fresh = self._load(cid)
        self._records.set(cid, MISSING if fresh is None else fresh)
        return fresh is None or (fresh.version, fresh.generation) != (rec.version, rec.generation)

    def _acquire_fd(self, cid: bytes, generation: int) -> FdHandle:
        key = (cid, generation)
        handle = self._fds.get(key)
        if handle is not None:
            return handle
        epoch = self._fds.epoch
        fd = os.open(self._path(cid, generation), os.O_RDWR | os.O_CLOEXEC)
        return self._fds.put(key, fd, epoch)

    def _lock(self, cid: bytes) -> threading.Lock:
        return self._locks[hash(cid) % LOCK_STRIPES]

    @contextlib.contextmanager
    def _locks_for(self, cids: Sequence[bytes]) -> Iterator[None]:
        """Several chunks' locks, taken in stripe order (no deadlock)."""
        with contextlib.ExitStack() as stack:
            for stripe in sorted({hash(c) % LOCK_STRIPES for c in cids}):
                stack.enter_context(self._locks[stripe])
            yield

    def _corrupt(self, cid: bytes, rec: ChunkRecord, block: int, problem: str) -> FsError:
        log.error(
            "%s target=%s chunk=%s block=%d offset=%d version=%d generation=%d path=%s",
            problem,
            self.label,
            cid.hex(),
            block,
            block * self.block_size,
            rec.version,
            rec.generation,
            self._path(cid, rec.generation),
        )
        return FsError(
            errno.EIO,
            f"{problem}: target {self.label} chunk {cid.hex()} block {block}",
        )

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

    def read_nowait(self, cid: bytes, offset: int, length: int) -> memoryview | None:
        """`read` if it can be done without blocking (record and fd cached,
        data in the page cache: preadv2 with RWF_NOWAIT); None otherwise,
        and for anything unusual, which `read` then handles in a thread."""
        check_chunk_id(cid)
        _check_range(offset, length)
        if not self._nowait:
            return None
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
        bs = self.block_size
        span = block_span(offset, length, rec.length, bs)
        if span is None:
            return EMPTY
        first, start, stop, end = span
        n = stop - start
        if n > NOWAIT_MAX:
            return None
        handle = self._fds.get((cid, rec.generation))
        if handle is None:
            return None
        buf = bytearray(n)
        try:
            got = os.preadv(handle.fd, [buf], start, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False
                log.info("target=%s: RWF_NOWAIT unsupported, reads use threads", self.label)
            return None
        finally:
            self._fds.release(handle)
        if got != n or first_bad_block(buf, first, rec.crcs, bs) >= 0:
            return None
        return memoryview(buf)[offset - start : end - start]

    # ---- writes: stage, then commit or abort -------------------------------

    def write(self, cid: bytes, offset: int, chunk_size: int, data: Data) -> WriteResult:
        """Write *data* at *offset*; durable (if fsync) and committed on return.
        A gap between the chunk's end and *offset* reads as zeros. The same
        as `stage_write` + `commit`, under the chunk's lock throughout."""
        with self._lock(cid):
            staged = self._stage_write_locked(cid, offset, data, chunk_size, None)
            return self._commit_locked(staged)

    def stage_write(
        self, cid: bytes, offset: int, data: Data, chunk_size: int, version: int | None = None
    ) -> Staged:
        """Make the chunk's next version (*data* at *offset*) durable on disk,
        invisible to readers until `commit`. *version* is the version the
        update produces: it must be the committed version + 1 (else
        `NEED_FULL`: this replica holds another base than the sender);
        None means exactly that. Appends go in place, past the committed
        length; overwrites into a new generation file. A zero-length write
        stages nothing (committing it changes nothing)."""
        with self._lock(cid):
            return self._stage_write_locked(cid, offset, data, chunk_size, version)

    def stage_replace(self, cid: bytes, data: Data, chunk_size: int, version: int) -> Staged:
        """Stage *data* as the chunk's whole content at *version* (a full
        resend along the chain, a resync or a repair copies a chunk from
        another replica), in a new generation file: whatever this target held
        before is replaced on commit, whatever its version was."""
        check_chunk_id(cid)
        check_chunk_size(chunk_size)
        if len(data) > chunk_size:
            raise FsError(errno.EINVAL, f"{len(data)} bytes do not fit the chunk size {chunk_size}")
        if version < 1:
            raise FsError(errno.EINVAL, f"chunk version {version} must be positive")
        with self._lock(cid):
            rec = self._record(cid)
            self._check_space(len(data))
            generation = next(self._next_gen)
            path = self._path(cid, generation)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise self._os_error(exc, f"replace of chunk {cid.hex()}") from None
            try:
                _pwrite_all(fd, data, 0)
                if self.fsync:
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path))
            except BaseException as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                if isinstance(exc, OSError) and not isinstance(exc, FsError):
                    raise self._os_error(exc, f"replace of chunk {cid.hex()}") from None
                raise
            crcs = block_crcs(data, self.block_size)
            new = ChunkRecord(version, generation, len(data), chunk_size, crcs)
            old_len = rec.length if rec is not None else 0
            return Staged(
                cid, REPLACE, rec, new, fd=fd, d_used=len(data) - old_len, d_chunks=rec is None
            )

    def commit(self, staged: Staged) -> WriteResult:
        """Make a staged update the chunk's committed state (one LMDB
        transaction). If the commit fails the update is aborted."""
        with self._lock(staged.cid):
            return self._commit_locked(staged)

    def abort(self, staged: Staged) -> None:
        """Drop a staged update without a trace: the bytes it appended past
        the committed length are cut, its new generation file is deleted.
        Aborting twice, or after a commit, does nothing."""
        with self._lock(staged.cid):
            self._abort_locked(staged)

    def staged_content(self, staged: Staged) -> bytes:
        """The whole chunk as the staged update makes it (for a full resend
        to a replica that lacks the base), verified against the new
        checksums: damage in blocks a copy-on-write carried over is refused
        with EIO rather than sent on."""
        if staged.done:
            raise FsError(errno.EINVAL, "the staged update is already committed or aborted")
        new = staged.new
        if new is None:
            raise FsError(errno.EINVAL, "a zero-length write has no content to send")
        fd = staged.fd if staged.handle is None else staged.handle.fd
        data = os.pread(fd, new.length, 0)
        if len(data) != new.length:
            raise self._corrupt(staged.cid, new, len(data) // self.block_size, "staged file short")
        bad = first_bad_block(data, 0, new.crcs, self.block_size)
        if bad >= 0:
            raise self._corrupt(staged.cid, new, bad, "checksum mismatch in staged update")
        return data

    def _stage_write_locked(
        self, cid: bytes, offset: int, data: Data, chunk_size: int, version: int | None
    ) -> Staged:
        check_chunk_id(cid)
        check_chunk_size(chunk_size)
        n = len(data)
        if offset < 0 or offset + n > chunk_size:
            raise FsError(
                errno.EINVAL, f"write {offset}+{n} does not fit the chunk size {chunk_size}"
            )
        rec = self._record(cid)
        if rec is not None and rec.chunk_size != chunk_size:
            raise FsError(
                errno.EINVAL,
                f"chunk {cid.hex()} has chunk size {rec.chunk_size}, not {chunk_size}",
            )
        current = rec.version if rec is not None else 0
        if version is not None and version != current + 1:
            raise FsError(
                NEED_FULL,
                f"chunk {cid.hex()} is at version {current} on target {self.label}; "
                f"an update to version {version} needs the whole chunk",
            )
        if n == 0:
            return Staged(cid, NOOP, rec, None)
        try:
            if rec is None or offset >= rec.length:
                return self._stage_in_place(cid, rec, offset, chunk_size, data, current + 1)
            return self._stage_cow(cid, rec, offset, data, current + 1)
        except FsError:
            raise
        except OSError as exc:
            raise self._os_error(exc, f"write to chunk {cid.hex()}") from None

    def _stage_in_place(
        self,
        cid: bytes,
        rec: ChunkRecord | None,
        offset: int,
        chunk_size: int,
        data: Data,
        version: int,
    ) -> Staged:
        old_len = rec.length if rec is not None else 0
        new_len = offset + len(data)
        self._check_space(new_len - old_len)
        handle: FdHandle | None = None
        if rec is None:
            generation = next(self._next_gen)
            path = self._path(cid, generation)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        else:
            generation = rec.generation
            path = self._path(cid, generation)
            try:
                handle = self._acquire_fd(cid, generation)
            except FileNotFoundError:
                raise self._corrupt(cid, rec, 0, "chunk file missing") from None
            fd = handle.fd
        wrote = staged = False
        try:
            if rec is not None:
                size = os.fstat(fd).st_size
                if size < old_len:
                    raise self._corrupt(
                        cid, rec, size // self.block_size, "chunk file shorter than committed"
                    )
                if size > old_len:  # the untrusted remains of an update that did not commit
                    os.ftruncate(fd, old_len)
            crcs = self._updated_crcs(cid, rec, fd, offset, data, new_len)
            wrote = True
            _pwrite_all(fd, data, offset)
            if self.fsync:
                if rec is None:
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path))
                else:
                    os.fdatasync(fd)
            new = ChunkRecord(version, generation, new_len, chunk_size, crcs)
            result = Staged(
                cid,
                APPEND if rec is not None else CREATE,
                rec,
                new,
                fd=fd if handle is None else -1,
                handle=handle,
                d_used=new_len - old_len,
                d_chunks=rec is None,
            )
            staged = True
            return result
        finally:
            if not staged:
                if handle is not None:
                    if wrote:  # drop what will never commit
                        with contextlib.suppress(OSError):
                            os.ftruncate(fd, old_len)
                    self._fds.release(handle)
                else:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def _stage_cow(
        self, cid: bytes, rec: ChunkRecord, offset: int, data: Data, version: int
    ) -> Staged:
        end = offset + len(data)
        new_len = max(rec.length, end)
        self._check_space(new_len)
        try:
            old = self._acquire_fd(cid, rec.generation)
        except FileNotFoundError:
            raise self._corrupt(cid, rec, 0, "chunk file missing") from None
        generation = next(self._next_gen)
        path = self._path(cid, generation)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                crcs = self._updated_crcs(cid, rec, old.fd, offset, data, new_len)
                _copy_range(old.fd, fd, 0, offset)
                if end < rec.length:
                    _copy_range(old.fd, fd, end, rec.length - end)
                _pwrite_all(fd, data, offset)
                if self.fsync:
                    os.fsync(fd)
                    fsync_dir(os.path.dirname(path))
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
        finally:
            self._fds.release(old)
        new = ChunkRecord(version, generation, new_len, rec.chunk_size, crcs)
        return Staged(cid, COW, rec, new, fd=fd, d_used=new_len - rec.length)

    def _commit_locked(self, staged: Staged) -> WriteResult:
        if staged.done:
            raise FsError(errno.EINVAL, "the staged update is already committed or aborted")
        new = staged.new
        if new is None:  # a zero-length write: nothing changes
            staged.done = True
            base = staged.base
            return {
                "version": base.version if base else 0,
                "length": base.length if base else 0,
            }
        try:
            current = self._record(staged.cid)
            if not _same_record(current, staged.base):
                raise FsError(
                    errno.EAGAIN,
                    f"chunk {staged.cid.hex()} changed on target {self.label} while an update "
                    "was staged",
                )
            self._commit([(staged.cid, new)], [], staged.d_used, int(staged.d_chunks))
        except BaseException:
            self._abort_locked(staged)
            raise
        staged.done = True
        if staged.handle is not None:  # an append: the file stays the same
            self._fds.release(staged.handle)
        else:
            self._fds.release(
                self._fds.put((staged.cid, new.generation), staged.fd, self._fds.epoch)
            )
            if staged.base is not None:
                self._discard_file(staged.cid, staged.base.generation)
        return {"version": new.version, "length": new.length}

    def _abort_locked(self, staged: Staged) -> None:
        if staged.done:
            return
        staged.done = True
        if staged.new is None:
            return
        if staged.handle is not None:
            base_len = staged.base.length if staged.base is not None else 0
            with contextlib.suppress(OSError):
                os.ftruncate(staged.handle.fd, base_len)
            self._fds.release(staged.handle)
            return
        os.close(staged.fd)
        with contextlib.suppress(OSError):
            os.unlink(self._path(staged.cid, staged.new.generation))

    def _updated_crcs(
        self,
        cid: bytes,
        rec: ChunkRecord | None,
        fd: int,
        offset: int,
        data: Data,
        new_len: int,
    ) -> array[int]:
        """The chunk's checksums after writing *data* at *offset*. Only the
        touched blocks are computed; old bytes that share a block with new
        ones are read back and verified first, so a corrupt block is never
        given a fresh, matching checksum."""
        bs = self.block_size
        old_len = rec.length if rec is not None else 0
        end = offset + len(data)
        b0 = min(offset, old_len) // bs
        b1 = block_count(end, bs)
        lo = b0 * bs
        hi = min(b1 * bs, new_len)
        span = bytearray(hi - lo)  # zeros: the gap of a sparse append
        for b in sorted({b0, b1 - 1}):
            blo = b * bs
            if rec is None or blo >= old_len:
                continue
            if offset <= blo and end >= min(blo + bs, new_len):
                continue  # wholly overwritten
            old = self._read_block_verified(cid, rec, fd, b)
            span[blo - lo : blo - lo + len(old)] = old
        span[offset - lo : end - lo] = data
        crcs = array(CRC_TYPECODE, rec.crcs[:b0]) if rec is not None else array(CRC_TYPECODE)
        zero = zero_block_crc(bs)
        view = memoryview(span)
        for blo in range(lo, hi, bs):
            bhi = min(blo + bs, hi)
            if blo >= old_len and bhi <= offset and bhi - blo == bs:
                crcs.append(zero)
            else:
                crcs.append(crc32c(bytes(view[blo - lo : bhi - lo])))
        if rec is not None and b1 < len(rec.crcs):
            crcs.extend(rec.crcs[b1:])
        return crcs

    def _read_block_verified(self, cid: bytes, rec: ChunkRecord, fd: int, block: int) -> bytes:
        bs = self.block_size
        lo = block * bs
        n = min(lo + bs, rec.length) - lo
        data = os.pread(fd, n, lo)
        if len(data) != n:
            raise self._corrupt(cid, rec, block, "chunk file shorter than committed")
        if crc32c(data) != rec.crcs[block]:
            raise self._corrupt(cid, rec, block, "checksum mismatch (refusing to update)")
        return data

    def _check_space(self, needed: int) -> None:
        """Refuse a write up front if it would eat into the reserve."""
        st = os.statvfs(self.path)
        avail = st.f_bavail * st.f_frsize
        if avail - self.reserve_bytes < needed:
            raise FsError(
                errno.ENOSPC,
                f"target {self.label}: {avail} bytes available, {self.reserve_bytes} reserved, "
                f"the write needs {needed}",
            )

    def _nearly_full(self) -> bool:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize <= self.reserve_bytes + (1 << 20)

    def _os_error(self, exc: OSError, what: str) -> FsError:
        if exc.errno in _NO_SPACE:
            log.warning("target=%s out of space during %s", self.label, what)
            return FsError(errno.ENOSPC, f"target {self.label}: no space left ({what})")
        log.error("target=%s %s failed: %s", self.label, what, exc)
        return FsError(exc.errno or errno.EIO, f"target {self.label}: {what}: {exc.strerror}")

    def _commit(
        self,
        puts: Sequence[tuple[bytes, ChunkRecord]],
        deletes: Sequence[bytes],
        d_used: int,
        d_chunks: int,
    ) -> None:
        """Apply record changes and the counters in one LMDB transaction,
        then show them to readers (the record cache)."""
        with self._commit_lock:
            used = self.used + d_used
            chunks = self.chunks + d_chunks
            try:
                with self.env.begin(write=True) as txn:
                    for cid, rec in puts:
                        txn.put(cid, rec.encode(), db=self.db_chunks)
                    for cid in deletes:
                        txn.delete(cid, db=self.db_chunks)
                    txn.put(STATS_USED, U64.pack(used), db=self.db_stats)
                    txn.put(STATS_CHUNKS, U64.pack(chunks), db=self.db_stats)
            except lmdb.MapFullError:
                log.warning("target=%s metadata map is full", self.label)
                raise FsError(errno.ENOSPC, f"target {self.label}: metadata map full") from None
            except lmdb.Error as exc:
                code = getattr(exc, "code", 0)
                # LMDB reports a short write (the disk filled) as EIO
                if code in _NO_SPACE or (code == errno.EIO and self._nearly_full()):
                    log.warning("target=%s out of space committing metadata", self.label)
                    raise FsError(
                        errno.ENOSPC, f"target {self.label}: no space left for metadata"
                    ) from None
                log.error("target=%s metadata commit failed: %s", self.label, exc)
                raise FsError(errno.EIO, f"target {self.label}: metadata commit failed") from None
            self.used, self.chunks = used, chunks
            for cid, rec in puts:
                self._records.set(cid, rec)
            for cid in deletes:
                self._records.set(cid, MISSING)

    def _discard_file(self, cid: bytes, generation: int) -> None:
        """Delete a file that is no longer committed (if this fails, the next
        start removes it)."""
        self._fds.invalidate((cid, generation))
        try:
            os.unlink(self._path(cid, generation))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning(
                "target=%s cannot delete old chunk file %s: %s",
                self.label,
                self._path(cid, generation),
                exc,
            )

    # ---- whole files -----------------------------------------------------

    def _scan_prefix(self, prefix: bytes, after: bytes | None, limit: int) -> list[bytes]:
        out: list[bytes] = []
        with self.env.begin(db=self.db_chunks) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(after or prefix):
                return out
            for key in cursor.iternext(values=False):
                if not key.startswith(prefix):
                    break
                if after is not None and key <= after:
                    continue
                out.append(bytes(key))
                if len(out) >= limit:
                    break
        return out

    def truncate_file(self, ino: int, size: int, chunk_size: int) -> int:
        """Cut this target's chunks of *ino* to a file size of *size*: chunks
        wholly past it are removed, the one it falls in is shortened.
        Returns how many chunks changed."""
        _check_ino(ino)
        check_chunk_size(chunk_size)
        if size < 0:
            raise FsError(errno.EINVAL, f"negative size {size}")
        return self._each_batch(ino, lambda cids: self._truncate_batch(cids, size, chunk_size))

    def remove_file(self, ino: int) -> int:
        """Remove every chunk of *ino* on this target; returns how many."""
        _check_ino(ino)
        return self._each_batch(ino, self._remove_batch)

    def _each_batch(self, ino: int, apply: Callable[[list[bytes]], int]) -> int:
        prefix = ino.to_bytes(8, "big")
        changed = 0
        after: bytes | None = None
        while True:
            cids = self._scan_prefix(prefix, after, BATCH)
            if not cids:
                return changed
            after = cids[-1]
            with self._locks_for(cids):
                try:
                    changed += apply(cids)
                except FsError:
                    raise
                except OSError as exc:
                    raise self._os_error(exc, f"update of inode {ino}") from None

    def _truncate_batch(self, cids: list[bytes], size: int, chunk_size: int) -> int:
        bs = self.block_size
        puts: list[tuple[bytes, ChunkRecord]] = []
        deletes: list[tuple[bytes, ChunkRecord]] = []
        d_used = 0
        for cid in cids:
            rec = self._record(cid)
            if rec is None:
                continue
            if rec.chunk_size != chunk_size:
                raise FsError(
                    errno.EINVAL,
                    f"chunk {cid.hex()} has chunk size {rec.chunk_size}, not {chunk_size}",
                )
            start = int.from_bytes(cid[8:], "big") * chunk_size
            if start >= size:
                deletes.append((cid, rec))
                d_used -= rec.length
            elif size - start < rec.length:
                new_len = size - start
                nblocks = block_count(new_len, bs)
                crcs = array(CRC_TYPECODE, rec.crcs[:nblocks])
                if new_len % bs:
                    handle = self._acquire_fd(cid, rec.generation)
                    try:
                        last = self._read_block_verified(cid, rec, handle.fd, nblocks - 1)
                    finally:
                        self._fds.release(handle)
                    crcs[-1] = crc32c(last[: new_len - (nblocks - 1) * bs])
                puts.append(
                    (cid, ChunkRecord(rec.version + 1, rec.generation, new_len, chunk_size, crcs))
                )
                d_used += new_len - rec.length
        if not puts and not deletes:
            return 0
        self._commit(puts, [cid for cid, _ in deletes], d_used, -len(deletes))
        for cid, new in puts:  # committed: the tail is now untrusted, cut it
            try:
                handle = self._acquire_fd(cid, new.generation)
                try:
                    os.ftruncate(handle.fd, new.length)
                finally:
                    self._fds.release(handle)
            except OSError as exc:
                log.warning("target=%s cannot cut chunk=%s: %s", self.label, cid.hex(), exc)
        for cid, rec in deletes:
            self._discard_file(cid, rec.generation)
        return len(puts) + len(deletes)

    def _remove_batch(self, cids: list[bytes]) -> int:
        gone = [(cid, rec) for cid in cids if (rec := self._record(cid)) is not None]
        if not gone:
            return 0
        self._commit([], [cid for cid, _ in gone], -sum(r.length for _, r in gone), -len(gone))
        for cid, rec in gone:
            self._discard_file(cid, rec.generation)
        return len(gone)

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

    def committed(self, cid: bytes) -> ChunkRecord | None:
        """The chunk's committed record (None if it does not exist)."""
        check_chunk_id(cid)
        return self._record(cid)

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
            if len(data) == rec.length and _same_record(self._record(cid), rec):
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

    def remove_chunk(self, cid: bytes) -> bool:
        """Delete one chunk (a replica's copy that its chain no longer holds);
        returns whether it existed."""
        check_chunk_id(cid)
        with self._lock(cid):
            try:
                return self._remove_batch([cid]) > 0
            except FsError:
                raise
            except OSError as exc:
                raise self._os_error(exc, f"removal of chunk {cid.hex()}") from None

    def list_range(self, after: bytes | None, until: bytes | None) -> dict[bytes, ChunkInfo]:
        """Every chunk with after < id <= until (None: unbounded), by id."""
        out: dict[bytes, ChunkInfo] = {}
        while True:
            page = self.list_chunks(after, LIST_MAX)
            for info in page["chunks"]:
                if until is not None and info["chunk"] > until:
                    return out
                out[info["chunk"]] = info
            if not page["more"] or not page["chunks"]:
                return out
            after = page["chunks"][-1]["chunk"]

    def list_chunks(self, after: bytes | None = None, limit: int = 1000) -> ChunkPage:
        """A page of chunks in id order, starting after *after*. Pages are
        also cut by checksum bytes so that a reply fits one frame."""
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

    def capacity(self) -> tuple[int, int]:
        """(capacity, free) of the target's filesystem; free is what the
        target may still use: available minus the reserve, never negative."""
        st = os.statvfs(self.path)
        return st.f_blocks * st.f_frsize, max(0, st.f_bavail * st.f_frsize - self.reserve_bytes)

    def stats(self) -> TargetStats:
        capacity, free = self.capacity()
        return {
            "target_id": self.target_id if self.target_id is not None else 0,
            "capacity": capacity,
            "free": free,
            "used": self.used,
            "chunks": self.chunks,
        }

    @property
    def cached_fds(self) -> int:
        return len(self._fds)
