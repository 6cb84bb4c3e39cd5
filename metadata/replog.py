"""The replication log: each committed group of mutations as one entry.

An entry is the group's effect on the namespace as key/value deltas
(`[db, key, value]`, value None for a delete), in the order they were made,
with a sequence number (1, 2, ...) and the epoch of the primary that wrote
it. Applying the deltas of entries 1..n to any copy of the namespace that
had 1..n-1 gives exactly the primary's records: nothing is re-executed, so
clocks, counters and layouts chosen on the primary are simply copied.

The log lives in the namespace's own LMDB environment (`replog`), and the
position (`repl`: applied seq and its epoch, the highest epoch seen, where
the log was trimmed) is written *in the same transaction* as the entry it
describes: after a crash the namespace, the log and the position agree,
always. A follower writes the entries it applies into its own log, so a
promoted follower can serve them to the others.

Everything here is synchronous and takes the raw LMDB transaction: the
callers (`txn.Transactions`, `replication.Follower`) own the transactions.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from shufflefs.metadata.records import ALL_DBS, DB_INFO, pack, read_u64, u64, unpack
from shufflefs.rpc.errors import FsError

DB_REPLOG = b"replog"  # seq -> [epoch, ops]
DB_REPL = b"repl"  # the position, below
REPL_DBS = (DB_REPLOG, DB_REPL)

K_APPLIED = b"applied_seq"
K_APPLIED_EPOCH = b"applied_epoch"
K_EPOCH = b"epoch"  # the highest epoch this server has seen (it refuses older ones)
K_TRIMMED = b"trimmed_seq"  # entries up to here are gone from the log
K_TRIMMED_EPOCH = b"trimmed_epoch"

Op = list[Any]  # [db name, key, value or None]
# only these sub-databases are replicated: `info` is each server's own
REPLICATED_DBS = frozenset(db for db in ALL_DBS if db != DB_INFO)


@dataclass(frozen=True)
class Position:
    applied_seq: int = 0
    applied_epoch: int = 0
    epoch: int = 0
    trimmed_seq: int = 0
    trimmed_epoch: int = 0

    def wire(self) -> dict[str, int]:
        return {
            "applied_seq": self.applied_seq,
            "applied_epoch": self.applied_epoch,
            "epoch": self.epoch,
        }


class ReplicationLog:
    """The log and position sub-databases of one namespace environment."""

    def __init__(self, dbs: dict[bytes, Any]) -> None:
        self.dbs = dbs
        self.log = dbs[DB_REPLOG]
        self.pos = dbs[DB_REPL]

    def _get(self, txn: Any, key: bytes) -> int:
        raw = txn.get(key, db=self.pos)
        return 0 if raw is None else read_u64(bytes(raw))

    def position(self, txn: Any) -> Position:
        return Position(
            self._get(txn, K_APPLIED),
            self._get(txn, K_APPLIED_EPOCH),
            self._get(txn, K_EPOCH),
            self._get(txn, K_TRIMMED),
            self._get(txn, K_TRIMMED_EPOCH),
        )

    def _advance(self, txn: Any, seq: int, epoch: int, ops: list[Op]) -> None:
        txn.put(u64(seq), pack([epoch, ops]), db=self.log)
        txn.put(K_APPLIED, u64(seq), db=self.pos)
        txn.put(K_APPLIED_EPOCH, u64(epoch), db=self.pos)
        if epoch > self._get(txn, K_EPOCH):
            txn.put(K_EPOCH, u64(epoch), db=self.pos)

    def append(self, txn: Any, epoch: int, ops: list[Op]) -> int:
        """On the primary, inside the group's transaction: the next entry."""
        seq = self._get(txn, K_APPLIED) + 1
        self._advance(txn, seq, epoch, ops)
        return seq

    def apply(self, txn: Any, seq: int, epoch: int, ops: list[Op]) -> None:
        """On a follower: apply entry *seq* (which must be the next one) and
        log it, in *txn*."""
        applied = self._get(txn, K_APPLIED)
        if seq != applied + 1:
            raise FsError(errno.EINVAL, f"log entry {seq} out of order (applied {applied})")
        for op in ops:
            db, key, value = bytes(op[0]), bytes(op[1]), op[2]
            if db not in REPLICATED_DBS:
                raise FsError(errno.EINVAL, f"log entry {seq} names sub-database {db!r}")
            if value is None:
                txn.delete(key, db=self.dbs[db])
            else:
                txn.put(key, bytes(value), db=self.dbs[db])
        self._advance(txn, seq, epoch, ops)

    def raise_epoch(self, txn: Any, epoch: int) -> None:
        if epoch > self._get(txn, K_EPOCH):
            txn.put(K_EPOCH, u64(epoch), db=self.pos)

    def epoch_at(self, txn: Any, seq: int) -> int | None:
        """The epoch of entry *seq*; None when this log cannot tell (beyond
        its end, or trimmed away)."""
        if seq == 0 and not self._get(txn, K_TRIMMED):
            return 0  # the start of a log nothing was trimmed from (once trimmed,
            # a new server at 0 lacks entries we no longer have: a snapshot)
        raw = txn.get(u64(seq), db=self.log)
        if raw is not None:
            return int(unpack(bytes(raw))[0])
        if seq == self._get(txn, K_TRIMMED):
            return self._get(txn, K_TRIMMED_EPOCH)
        return None

    def entries(self, txn: Any, first: int, max_bytes: int) -> list[list[Any]]:
        """Entries from *first* on, `[seq, epoch, ops]`, about *max_bytes* at
        most (at least one, if there is one)."""
        out: list[list[Any]] = []
        size = 0
        cur = txn.cursor(db=self.log)
        if not cur.set_key(u64(first)):
            return out
        for key, raw in cur.iternext():
            epoch, ops = unpack(bytes(raw))
            out.append([read_u64(bytes(key)), epoch, ops])
            size += len(raw)
            if size >= max_bytes:
                break
        return out

    def trim(self, txn: Any, through: int) -> int:
        """Drop entries up to *through*; returns how many went."""
        epoch = self.epoch_at(txn, through)
        if epoch is None or through <= self._get(txn, K_TRIMMED):
            return 0
        cur = txn.cursor(db=self.log)
        dropped = 0
        if cur.first():
            while cur.key() and read_u64(bytes(cur.key())) <= through:
                dropped += 1
                if not cur.delete():
                    break
        txn.put(K_TRIMMED, u64(through), db=self.pos)
        txn.put(K_TRIMMED_EPOCH, u64(epoch), db=self.pos)
        return dropped
