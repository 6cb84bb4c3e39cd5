"""The queue of work the namespace owes the storage daemons.

A mutation that frees a regular file or shrinks one records a job *in its
own transaction* (`record_gc`, `record_truncate`), so the namespace and the
debt to storage can never disagree after a crash. `gc.StorageJobs` reads the
jobs (`JobQueue`), carries them out on the chains and deletes each one only
once every chain has confirmed.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

from shufflefs.metadata.checks import U64_MAX
from shufflefs.metadata.protocol import FilesPage, Layout
from shufflefs.metadata.records import (
    C_JOB,
    DB_GC,
    DB_INODES,
    DB_TRUNCATES,
    GcJob,
    TruncateJob,
    gc_job,
    gc_record,
    is_reg,
    layout_of,
    read_u64,
    truncate_job,
    truncate_record,
    u64,
    unpack,
)
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError

FILES_PAGE_MAX = 4096  # regular files per `files_page`

J = TypeVar("J", GcJob, TruncateJob)


def record_gc(tx: Tx, ino: int, layout: Layout) -> None:
    """Owe the storage daemons the removal of a freed file's chunks."""
    tx.put(DB_GC, u64(ino), gc_record(layout, tx.now))


def record_truncate(tx: Tx, ino: int, layout: Layout, size: int) -> None:
    """Owe the storage daemons a cut of *ino* to *size*. A job still pending
    from an earlier shrink keeps the smaller size, so bytes past either cut
    can never come back."""
    old = tx.get_raw(DB_TRUNCATES, u64(ino))
    if old is not None:
        size = min(size, int(unpack(old)["size"]))
    seq = tx.next_id(C_JOB)
    tx.put(DB_TRUNCATES, u64(ino), truncate_record(size, layout, seq, tx.now))


def drop_truncate(tx: Tx, ino: int) -> None:
    """A freed file's pending cut is moot: GC removes every chunk."""
    tx.delete(DB_TRUNCATES, u64(ino))


def _page(tx: Tx, db: bytes, after: int, limit: int, decode: Callable[[int, bytes], J]) -> list[J]:
    """Up to *limit* jobs of *db* with inode numbers above *after*, in order."""
    out: list[J] = []
    first = max(after, 0) + 1
    if first > U64_MAX:
        return out
    for key, raw in tx.prefix_items(db, b"", u64(first)):
        out.append(decode(read_u64(key), raw))
        if len(out) >= limit:
            break
    return out


class JobQueue:
    """The jobs API of `NamespaceStore`: list pending jobs, mark them done."""

    txns: Transactions

    def gc_jobs(self, after: int = 0, limit: int = 256) -> list[GcJob]:
        """Freed files whose chunks are still to be deleted, by inode."""
        return self.txns.read(lambda tx: _page(tx, DB_GC, after, limit, gc_job))

    def files_page(self, after: int = 0, limit: int = 1024) -> FilesPage:
        """Every regular file's (inode, size, layout) with inode numbers above
        *after*, named or not (an unlinked file still open keeps its chunks):
        what `shufflefs fsck` checks the storage targets against. One read
        transaction per page, never a write."""
        if limit < 1:
            raise FsError(errno.EINVAL, f"limit {limit} < 1")
        limit = min(limit, FILES_PAGE_MAX)

        def body(tx: Tx) -> FilesPage:
            files: list[tuple[int, int, Layout]] = []
            first = max(after, 0) + 1
            if first > U64_MAX:
                return {"files": files, "more": False}
            for key, raw in tx.prefix_items(DB_INODES, b"", u64(first)):
                if len(files) == limit:
                    return {"files": files, "more": True}
                rec = unpack(raw)
                layout = layout_of(rec) if is_reg(rec) else None
                if layout is not None:
                    files.append((read_u64(key), int(rec["size"]), layout))
            return {"files": files, "more": False}

        return self.txns.read(body)

    def gc_done(self, ino: int) -> None:
        self.txns.write(lambda tx: tx.delete(DB_GC, u64(ino)))

    def gc_done_all(self, inos: list[int]) -> None:
        """`gc_done` of a batch, in one transaction."""

        def body(tx: Tx) -> None:
            for ino in inos:
                tx.delete(DB_GC, u64(ino))

        self.txns.write(body)

    def truncate_job(self, ino: int) -> TruncateJob | None:
        def body(tx: Tx) -> TruncateJob | None:
            raw = tx.get_raw(DB_TRUNCATES, u64(ino))
            return None if raw is None else truncate_job(ino, raw)

        return self.txns.read(body)

    def truncate_jobs(self, after: int = 0, limit: int = 256) -> list[TruncateJob]:
        return self.txns.read(lambda tx: _page(tx, DB_TRUNCATES, after, limit, truncate_job))

    def truncate_done(self, ino: int, seq: int) -> bool:
        """Delete the job if it is still the one carried out (*seq*); a newer
        shrink recorded meanwhile must run too. Returns whether it was deleted."""

        def body(tx: Tx) -> bool:
            raw = tx.get_raw(DB_TRUNCATES, u64(ino))
            if raw is None or unpack(raw)["seq"] != seq:
                return False
            tx.delete(DB_TRUNCATES, u64(ino))
            return True

        return self.txns.write(body)
