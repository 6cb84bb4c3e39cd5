"""The queue of work the namespace owes the storage daemons.

A mutation that frees a regular file or shrinks one records a job *in its
own transaction* (`record_gc`, `record_truncate`), so the namespace and the
debt to storage can never disagree after a crash. `gc.StorageJobs` reads the
jobs (`JobQueue`), carries them out on the chains and deletes each one only
once every chain has confirmed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from shufflefs.metadata.checks import U64_MAX
from shufflefs.metadata.protocol import Layout
from shufflefs.metadata.records import (
    C_JOB,
    DB_GC,
    DB_TRUNCATES,
    GcJob,
    TruncateJob,
    gc_job,
    gc_record,
    read_u64,
    truncate_job,
    truncate_record,
    u64,
    unpack,
)
from shufflefs.metadata.txn import Transactions, Tx

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

    def gc_done(self, ino: int) -> None:
        self.txns.write(lambda tx: tx.delete(DB_GC, u64(ino)))

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
