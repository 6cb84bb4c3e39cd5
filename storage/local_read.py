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

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import lmdb

from shufflefs.rpc.errors import FsError
from shufflefs.storage.crc import first_bad_block
from shufflefs.storage.layout import (
    CHUNKS_DIR,
    META_DIR,
    TARGET_FILE,
    ChunkRecord,
    block_count,
    chunk_dir_name,
    chunk_file_name,
    read_json,
)

log = logging.getLogger("shufflefs.storage.local_read")

EMPTY = memoryview(b"")
MAX_FDS = 1024
MAX_RECORDS = 1 << 18


class LocalTarget:
    """Read-only access to one target directory on this host."""

    def __init__(self, path: str | Path, target_id: int, cluster_id: str) -> None:
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
        # open chunk files, least recently used first; readers in several
        # threads share them, so an fd is closed only while nobody uses it
        self._fds: OrderedDict[tuple[bytes, int], int] = OrderedDict()
        self._busy: dict[int, int] = {}
        # fds dropped from the cache while a read still uses them: closed by
        # the last user (an open fd would pin a removed chunk file's space)
        self._closing: set[int] = set()
        self._lock = threading.Lock()
        # Committed records read before, reused until the caller says the file
        # may have changed (`forget`): close-to-open, as the kernel caches data.
        # Without it every read of cold data would also fault in chunk-table
        # pages from disk.
        self._records: dict[bytes, ChunkRecord] = {}
        self._chunks = str(self.path / CHUNKS_DIR)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self.env.close()

    def _record(self, cid: bytes) -> ChunkRecord | None:
        cached = self._records.get(cid)
        if cached is not None:
            return cached
        with self.env.begin(db=self.db, buffers=True) as txn:
            raw = txn.get(cid)
            rec = None if raw is None else ChunkRecord.decode(raw, self.block_size)
        if rec is not None:
            with self._lock:
                if len(self._records) >= MAX_RECORDS:
                    self._records.clear()
                self._records[cid] = rec
        return rec

    def forget(self, cids: Iterable[bytes] | None = None) -> None:
        """Drop cached chunk records and open chunk files (all, or those of
        *cids*): the caller knows they may have changed (the file was opened
        again, written, or closed). Closing the files matters as much as the
        records: a cached fd keeps a chunk the daemon removed (or replaced by
        copy-on-write) on disk, and its space is not freed."""
        with self._lock:
            if cids is None:
                self._records.clear()
                self._drop_fds(list(self._fds))
            else:
                wanted = set(cids)
                for cid in wanted:
                    self._records.pop(cid, None)
                self._drop_fds([k for k in self._fds if k[0] in wanted])

    def forget_file(self, ino: int) -> None:
        """`forget` every chunk of one file."""
        prefix = ino.to_bytes(8, "big")
        with self._lock:
            for cid in [c for c in self._records if c[:8] == prefix]:
                del self._records[cid]
            self._drop_fds([k for k in self._fds if k[0][:8] == prefix])

    def _drop_fds(self, keys: list[tuple[bytes, int]]) -> None:
        """Close cached fds (the caller holds the lock); one still in use
        is closed by its last user."""
        for key in keys:
            fd = self._fds.pop(key)
            if self._busy.get(fd):
                self._closing.add(fd)
            else:
                os.close(fd)

    def _acquire_fd(self, cid: bytes, generation: int) -> int:
        key = (cid, generation)
        with self._lock:
            fd = self._fds.get(key)
            if fd is not None:
                self._fds.move_to_end(key)
                self._busy[fd] = self._busy.get(fd, 0) + 1
                return fd
        path = f"{self._chunks}/{chunk_dir_name(cid)}/{chunk_file_name(cid, generation)}"
        fd = os.open(path, os.O_RDONLY)
        with self._lock:
            old = self._fds.get(key)
            if old is not None:  # another thread opened it meanwhile: keep one
                self._busy[fd] = 1
                self._closing.add(fd)
                return fd
            self._fds[key] = fd
            self._busy[fd] = 1
            if len(self._fds) > MAX_FDS:
                self._drop_fds(list(self._fds)[: len(self._fds) - MAX_FDS])
        return fd

    def _release_fd(self, fd: int, stale_key: tuple[bytes, int] | None = None) -> None:
        with self._lock:
            left = self._busy.get(fd, 1) - 1
            if left > 0:
                self._busy[fd] = left
            else:
                self._busy.pop(fd, None)
            if stale_key is not None and self._fds.get(stale_key) == fd:
                self._drop_fds([stale_key])
            elif left <= 0 and fd in self._closing:
                self._closing.discard(fd)
                os.close(fd)

    def read(self, cid: bytes, offset: int, length: int, nowait: bool) -> memoryview | None:
        """The committed bytes of [offset, offset + length) of a chunk (short
        past its end, empty if it does not exist); None if the daemon must
        answer, or, with *nowait*, if the bytes are not in the page cache."""
        try:
            rec = self._record(cid)
        except (lmdb.Error, FsError) as exc:
            log.debug("target=%d: chunk table unreadable here: %s", self.target_id, exc)
            return None
        if rec is None:
            return EMPTY
        end = min(offset + length, rec.length)
        if end <= offset:
            return EMPTY
        bs = self.block_size
        first = offset // bs
        start = first * bs
        n = min(block_count(end, bs) * bs, rec.length) - start
        buf = bytearray(n)
        try:
            fd = self._acquire_fd(cid, rec.generation)
        except OSError:  # the generation was replaced (copy-on-write): ask the daemon
            self.forget([cid])
            return None
        try:
            got = os.preadv(fd, [buf], start, os.RWF_NOWAIT if nowait else 0)
        except BlockingIOError:
            self._release_fd(fd)
            return None
        except OSError:
            self._release_fd(fd, (cid, rec.generation))
            self.forget([cid])
            return None
        self._release_fd(fd)
        if got != n or first_bad_block(buf, first, rec.crcs, bs) >= 0:
            self.forget([cid])  # changed under us (or damaged): the daemon decides
            return None
        return memoryview(buf)[offset - start : end - start]
