"""Updates of a whole file's chunks on a target, committed in batches.

`truncate_file` and `remove_file` change every chunk of one inode that this
target holds. The chunk ids of an inode are one contiguous key range, so
each is a prefix scan, taken `BATCH` chunks at a time under those chunks'
locks, with one LMDB transaction per batch (atomic per batch, not per file);
`remove_files` takes the chunks of many inodes `BATCH` at a time the same way.
Records are committed first, then files are cut or deleted, as for every
update (docs/storage.md, "Writes and why they are crash safe"). The
stage/commit protocol of single-chunk updates (`storage/staging.py`) is
built on this class and shares its verified block read.
"""

from __future__ import annotations

import errno
import logging
import os
from array import array
from collections.abc import Callable

from shufflefs.rpc.errors import FsError
from shufflefs.storage.crc import CRC_TYPECODE, crc32c
from shufflefs.storage.layout import ChunkRecord, block_count, check_chunk_id, check_chunk_size
from shufflefs.storage.target import Target

log = logging.getLogger("shufflefs.storage.whole_files")

BATCH = 512  # chunks per transaction in truncate_file / remove_file


def _check_ino(ino: int) -> None:
    if not 0 <= ino < 1 << 64:
        raise FsError(errno.EINVAL, f"inode {ino} out of range")


class WholeFiles(Target):
    """A `Target` with the file-wide updates (truncate, remove) and the
    verified block read they share with partial-block writes."""

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

    def remove_files(self, inos: list[int]) -> int:
        """`remove_file` of each of *inos* (one call from the event loop for
        a batch of freed files); returns how many chunks. The chunks of all
        of them go `BATCH` to a transaction: a batch of small files is one
        durable commit, not one per file (atomic per batch, as ever)."""
        for ino in inos:
            _check_ino(ino)
        cids = [cid for ino in inos for cid in self._chunks_of(ino)]
        removed = 0
        for lo in range(0, len(cids), BATCH):
            removed += self._apply(cids[lo : lo + BATCH], self._remove_batch, "removal of files")
        return removed

    def _chunks_of(self, ino: int) -> list[bytes]:
        prefix = ino.to_bytes(8, "big")
        out: list[bytes] = []
        while True:  # (a short page is the last: no scan that finds nothing)
            page = self._scan_prefix(prefix, out[-1] if out else None, BATCH)
            out.extend(page)
            if len(page) < BATCH:
                return out

    def _each_batch(self, ino: int, apply: Callable[[list[bytes]], int]) -> int:
        prefix = ino.to_bytes(8, "big")
        changed = 0
        after: bytes | None = None
        while True:
            cids = self._scan_prefix(prefix, after, BATCH)
            if not cids:
                return changed
            after = cids[-1]
            changed += self._apply(cids, apply, f"update of inode {ino}")

    def _apply(self, cids: list[bytes], apply: Callable[[list[bytes]], int], what: str) -> int:
        """*apply* to *cids* under their locks; an OS error as ours."""
        with self._locks_for(cids):
            try:
                return apply(cids)
            except FsError:
                raise
            except OSError as exc:
                raise self._os_error(exc, what) from None

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
