"""`Target`: one target directory on disk, its format and its recovery.

A target is a directory of chunk files plus an LMDB environment of chunk
records (the on-disk layout is in `shufflefs.storage.layout` and
docs/storage.md). This layer opens or formats the directory, recovers it at
open (files whose generation is not the committed one are the remains of an
update a crash interrupted, and are deleted), caches records and open files,
and owns the one LMDB transaction that changes records. Updates are built on
top of it in `staging.py`, reads and listing in `store.py`.

Every method may block on disk I/O; the storage service calls them from
worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import lmdb

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import read_json, write_json_durably
from shufflefs.storage.cache import MISSING, FdCache, FdHandle, Missing, RecordCache
from shufflefs.storage.cached_open import open_cached
from shufflefs.storage.group_sync import FileSync, GroupRunner
from shufflefs.storage.layout import (
    CHUNKS_DIR,
    FORMAT_VERSION,
    META_DIR,
    RECORD_HEADER,
    TARGET_FILE,
    ChunkRecord,
    check_block_size,
    check_chunk_id,
    chunk_dir_name,
    chunk_file_name,
    parse_chunk_file_name,
)
from shufflefs.storage.protocol import TargetStats

log = logging.getLogger("shufflefs.storage.target")

LOCK_STRIPES = 1024  # chunk locks: writers to one chunk are serialized, readers take none
DEFAULT_MAP_SIZE = 256 << 30  # LMDB address space (virtual; the file grows as needed)

STATS_USED = b"used"
STATS_CHUNKS = b"chunks"
U64 = struct.Struct(">Q")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class RecordChange:
    """One caller's part of a (grouped) record commit."""

    puts: Sequence[tuple[bytes, ChunkRecord]]
    deletes: Sequence[bytes]
    d_used: int
    d_chunks: int


class Target:
    """One target directory: chunk files plus an LMDB env of chunk records.

    Thread safe: any number of readers and writers may call in concurrently.
    Writers to one chunk are serialized by a striped lock (`_lock`); readers
    take no lock and instead validate what they read against the record."""

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
        self._last_available = 0  # bytes available, as the last statvfs saw it
        info = self._open_or_format(block_size)
        self._available()
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
            # group flushes (storage/group_sync.py): the staged bytes, the record commits
            self._file_sync = FileSync()
            self._record_commits: GroupRunner[RecordChange] = GroupRunner(self._commit_batch)
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
        files, commits = self._file_sync.runner, self._record_commits
        if commits.items:
            log.info(
                "group flushes target=%s file_flushes=%d file_passes=%d record_commits=%d "
                "transactions=%d",
                self.label,
                files.items,
                files.batches,
                commits.items,
                commits.batches,
            )
        self._fds.close_all()
        self.env.close()

    def __enter__(self) -> Self:
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
        """Did the chunk change after *rec* was read? (Then its cached record
        is forgotten, never replaced: a reader holds no lock, and a writer
        may have cached a newer record since this one loaded; put back, a
        stale record sent the next write to a file already deleted.)"""
        fresh = self._load(cid)
        changed = fresh is None or (fresh.version, fresh.generation) != (
            rec.version,
            rec.generation,
        )
        if changed:
            self._records.invalidate(cid)
        return changed

    def _acquire_fd(self, cid: bytes, generation: int) -> FdHandle:
        key = (cid, generation)
        handle = self._fds.get(key)
        if handle is not None:
            return handle
        epoch = self._fds.epoch
        fd = os.open(self._path(cid, generation), os.O_RDWR | os.O_CLOEXEC)
        return self._fds.put(key, fd, epoch)

    def _open_cached(self, cid: bytes, generation: int) -> FdHandle | None:
        """`_acquire_fd` of a file not held, if opening it waits for no
        disk (storage/cached_open.py); None otherwise, and for a file that
        is not there (`read` reports it)."""
        epoch = self._fds.epoch
        try:
            fd = open_cached(self._path(cid, generation), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        return None if fd is None else self._fds.put((cid, generation), fd, epoch)

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

    # ---- space and errors ------------------------------------------------

    def check_room(self, needed: int) -> None:
        """ENOSPC if *needed* more bytes would eat into the reserve, as far
        as the last look at the disk tells. A replica asks before it
        forwards an update, so that a full disk fails the update on every
        replica alike; on the event loop, so no statvfs here: every stage
        looks (in a worker thread) and checks again, and so do the capacity
        figures each second."""
        if self._last_available - self.reserve_bytes < needed:
            raise FsError(
                errno.ENOSPC,
                f"target {self.label}: {self._last_available} bytes available, "
                f"{self.reserve_bytes} reserved, the write needs {needed}",
            )

    def _available(self) -> int:
        st = os.statvfs(self.path)
        self._last_available = st.f_bavail * st.f_frsize
        return self._last_available

    def _check_space(self, needed: int) -> None:
        """Refuse a write up front if it would eat into the reserve."""
        avail = self._available()
        if avail - self.reserve_bytes < needed:
            raise FsError(
                errno.ENOSPC,
                f"target {self.label}: {avail} bytes available, {self.reserve_bytes} reserved, "
                f"the write needs {needed}",
            )

    def _nearly_full(self) -> bool:
        return self._available() <= self.reserve_bytes + (1 << 20)

    def _os_error(self, exc: OSError, what: str) -> FsError:
        if exc.errno in NO_SPACE:
            log.warning("target=%s out of space during %s", self.label, what)
            return FsError(errno.ENOSPC, f"target {self.label}: no space left ({what})")
        log.error("target=%s %s failed: %s", self.label, what, exc)
        return FsError(exc.errno or errno.EIO, f"target {self.label}: {what}: {exc.strerror}")

    # ---- the one transaction that changes records -------------------------

    def _commit(
        self,
        puts: Sequence[tuple[bytes, ChunkRecord]],
        deletes: Sequence[bytes],
        d_used: int,
        d_chunks: int,
    ) -> None:
        """Apply record changes and the counters in one LMDB transaction,
        then show them to readers (the record cache). Changes of other
        chunks committed meanwhile share the transaction (and its flush):
        the caller holds the locks of its chunks, so no two changes of a
        batch touch the same record. Returns once the transaction is
        durable; if it fails, every change of the batch fails."""
        self._record_commits.run(RecordChange(puts, deletes, d_used, d_chunks))

    def _commit_many(self, changes: Sequence[RecordChange]) -> list[BaseException | None]:
        """`_commit` of several callers' changes at once (in one transaction
        as far as the batch allows): per change None or its error."""
        return self._record_commits.run_many(changes)

    def _commit_batch(self, changes: list[RecordChange]) -> list[BaseException | None]:
        with self._commit_lock:
            used = self.used + sum(c.d_used for c in changes)
            chunks = self.chunks + sum(c.d_chunks for c in changes)
            try:
                with self.env.begin(write=True) as txn:
                    for change in changes:
                        for cid, rec in change.puts:
                            txn.put(cid, rec.encode(), db=self.db_chunks)
                        for cid in change.deletes:
                            txn.delete(cid, db=self.db_chunks)
                    txn.put(STATS_USED, U64.pack(used), db=self.db_stats)
                    txn.put(STATS_CHUNKS, U64.pack(chunks), db=self.db_stats)
            except lmdb.MapFullError:
                log.warning("target=%s metadata map is full", self.label)
                raise FsError(errno.ENOSPC, f"target {self.label}: metadata map full") from None
            except lmdb.Error as exc:
                code = getattr(exc, "code", 0)
                # LMDB reports a short write (the disk filled) as EIO
                if code in NO_SPACE or (code == errno.EIO and self._nearly_full()):
                    log.warning("target=%s out of space committing metadata", self.label)
                    raise FsError(
                        errno.ENOSPC, f"target {self.label}: no space left for metadata"
                    ) from None
                log.error("target=%s metadata commit failed: %s", self.label, exc)
                raise FsError(errno.EIO, f"target {self.label}: metadata commit failed") from None
            self.used, self.chunks = used, chunks
            for change in changes:
                for cid, rec in change.puts:
                    self._records.set(cid, rec)
                for cid in change.deletes:
                    self._records.set(cid, MISSING)
        return [None] * len(changes)

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

    # ---- figures -----------------------------------------------------------

    def committed(self, cid: bytes) -> ChunkRecord | None:
        """The chunk's committed record (None if it does not exist)."""
        check_chunk_id(cid)
        return self._record(cid)

    def capacity(self) -> tuple[int, int]:
        """(capacity, free) of the target's filesystem; free is what the
        target may still use: available minus the reserve, never negative."""
        st = os.statvfs(self.path)
        self._last_available = st.f_bavail * st.f_frsize
        return st.f_blocks * st.f_frsize, max(0, self._last_available - self.reserve_bytes)

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
