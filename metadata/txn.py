"""The one place where LMDB transactions of the namespace are opened and
committed, and the view of the namespace that an operation works on.

Every mutation is exactly one `Transactions.write`: its body runs against a
`Tx`, and either all of it commits or none of it does, so a process killed at
any instant leaves the whole operation or nothing (LMDB commits by
copy-on-write and one meta-page write; there is no journal and no recovery
pass to get wrong). Reads are `Transactions.read`: a snapshot that never
waits for the writer.

Every change an operation makes goes through `Tx.put` / `Tx.delete` (or the
inode cache that `Tx.flush` writes back), never through the raw LMDB
transaction. That keeps two things possible here without touching the
operations: committing several mutations in one transaction (group commit)
and shipping each committed transaction's changes to followers.
"""

from __future__ import annotations

import errno
import logging
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lmdb

from shufflefs.metadata.checks import check_ino
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.readonly import ReadOnlyHandles
from shufflefs.metadata.records import (
    DB_COUNTERS,
    DB_DENTRIES,
    DB_INODES,
    U64,
    Rec,
    dentry_child,
    dentry_key,
    dentry_value,
    is_dir,
    pack,
    read_u64,
    u64,
    unpack,
)
from shufflefs.metadata.replog import Op, Position, ReplicationLog
from shufflefs.rpc.errors import FsError

T = TypeVar("T")

log = logging.getLogger("shufflefs.metadata.namespace")


class Tx:
    """One transaction's view of the namespace, with an inode cache.

    Inode records are loaded once per transaction and written back at the
    end only if they changed, so an operation that touches the same inode
    twice (a rename within one directory) can never write a stale copy over
    a fresh one.
    """

    def __init__(self, txn: Any, dbs: dict[bytes, Any], read_only: ReadOnlyHandles) -> None:
        self.txn = txn
        self.dbs = dbs
        self.read_only = read_only  # the in-memory read-only handles (readonly.py)
        self.now = time.time_ns()  # the time stamped on everything this transaction changes
        self._recs: dict[int, Rec | None] = {}
        self._raw: dict[int, bytes | None] = {}
        self.ended: list[Callable[[bool], None]] = []
        self.changed: dict[int, int] = {}  # ino -> its change counter, raised by `flush`
        self.changed_files: dict[int, int] = {}  # the regular files among them
        self.changed_dirs: dict[int, int] = {}  # the directories among them
        # the session this mutation is for, when the request names one (a
        # create): its cache watch is not told of its own directory changes
        self.by: int | None = None
        self.ops: list[Op] = []  # every put/delete, in order: the replication log's entry

    def after(self, fn: Callable[[bool], None]) -> None:
        """Call *fn(committed)* once this transaction has committed or aborted
        (in-memory state that must follow the transaction's fate)."""
        self.ended.append(fn)

    # ---- any sub-database --------------------------------------------------

    def get_raw(self, db: bytes, key: bytes) -> bytes | None:
        raw = self.txn.get(key, db=self.dbs[db])
        return None if raw is None else bytes(raw)

    def put(self, db: bytes, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self.dbs[db])
        self.ops.append([db, key, value])

    def delete(self, db: bytes, key: bytes) -> bool:
        """Returns whether the key was there."""
        there = bool(self.txn.delete(key, db=self.dbs[db]))
        if there:
            self.ops.append([db, key, None])
        return there

    def has_prefix(self, db: bytes, prefix: bytes) -> bool:
        cur = self.txn.cursor(db=self.dbs[db])
        return bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)

    def prefix_items(
        self, db: bytes, prefix: bytes, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Items whose key starts with *prefix*, from key *start* on."""
        cur = self.txn.cursor(db=self.dbs[db])
        if not cur.set_range(prefix if start is None else start):
            return
        for key, value in cur.iternext():
            if not key.startswith(prefix):
                return
            yield bytes(key), bytes(value)

    def children(
        self, parent: int, after: bytes | None, limit: int
    ) -> tuple[list[tuple[bytes, int, Rec]], bool]:
        """Up to *limit* entries of directory *parent* in name order after
        the name *after*: (name, inode, record); and whether more follow.
        A listing's loop: one cursor walk and one record fetch per entry,
        with none of `get`'s per-call layers (a listing of 20,000 names
        spent half its time in them); records this transaction changed are
        taken from it."""
        prefix = U64.pack(parent)
        cur = self.txn.cursor(db=self.dbs[DB_DENTRIES])
        if not cur.set_range(prefix + (after or b"")):
            return [], False
        fetch, inodes, recs = self.txn.get, self.dbs[DB_INODES], self._recs
        out: list[tuple[bytes, int, Rec]] = []
        for key, value in cur.iternext():
            if not key.startswith(prefix):
                return out, False
            name = key[8:]
            if name == after:
                continue
            if len(out) == limit:
                return out, True
            child = dentry_child(value)
            if child in recs:
                rec = recs[child]
            else:
                raw = fetch(U64.pack(child), db=inodes)
                rec = None if raw is None else unpack(raw)
            if rec is None:
                log.warning("dentry %r in directory %d points to missing inode", name, parent)
                continue
            out.append((name, child, rec))
        return out, False

    def entries(self, db: bytes) -> int:
        """How many items *db* holds."""
        return int(self.txn.stat(self.dbs[db])["entries"])

    def next_id(self, counter: bytes) -> int:
        raw = self.get_raw(DB_COUNTERS, counter)
        value = read_u64(raw) if raw is not None else 1
        self.put(DB_COUNTERS, counter, u64(value + 1))
        return value

    # ---- inodes ------------------------------------------------------------

    def get(self, ino: int) -> Rec | None:
        if ino in self._recs:
            return self._recs[ino]
        raw = self.get_raw(DB_INODES, u64(ino))
        rec = None if raw is None else unpack(raw)
        self._recs[ino] = rec
        self._raw[ino] = raw
        return rec

    def inode(self, ino: int) -> Rec:
        check_ino(ino)
        rec = self.get(ino)
        if rec is None:
            raise FsError(errno.ENOENT, f"no inode {ino}")
        return rec

    def directory(self, ino: int) -> Rec:
        rec = self.inode(ino)
        if not is_dir(rec):
            raise FsError(errno.ENOTDIR, f"inode {ino} is not a directory")
        return rec

    def live_directory(self, ino: int) -> Rec:
        """A directory new entries may go into (not one already removed)."""
        rec = self.directory(ino)
        if rec["nlink"] == 0:
            raise FsError(errno.ENOENT, f"directory {ino} was removed")
        return rec

    def add_inode(self, ino: int, rec: Rec) -> None:
        self._recs[ino] = rec
        self._raw[ino] = None

    def drop_inode(self, ino: int) -> None:
        """Delete the inode's record when the transaction is flushed."""
        self._recs[ino] = None

    def touch_dir(self, rec: Rec) -> None:
        rec["mtime"] = rec["ctime"] = self.now

    def flush(self) -> None:
        """Write back every inode record that changed."""
        for ino, rec in self._recs.items():
            old = self._raw.get(ino)
            if rec is None:
                if old is not None:
                    self.delete(DB_INODES, u64(ino))
                    gone = unpack(old)
                    if stat.S_ISDIR(gone.get("mode", 0)):
                        # a watched listing of it ends too (cache_watch.py):
                        # its name must no longer lead to it
                        self.changed_dirs[ino] = gone.get("change", 0) + 1
                continue
            raw = pack(rec)
            if raw != old:
                # every committed change of an inode record raises its change
                # counter: a client that cached the file at counter N knows
                # it is unchanged while getattr still says N (open_cache.py)
                rec["change"] = rec.get("change", 0) + 1
                self.changed[ino] = rec["change"]
                if stat.S_ISREG(rec.get("mode", 0)):
                    self.changed_files[ino] = rec["change"]
                elif stat.S_ISDIR(rec.get("mode", 0)):
                    self.changed_dirs[ino] = rec["change"]
                self.put(DB_INODES, u64(ino), pack(rec))

    def changed_by(self) -> dict[int, int | None]:
        """Each directory this transaction changed, with its changer (`by`)."""
        return dict.fromkeys(self.changed_dirs, self.by)

    def stamped(self, result: T) -> T:
        """*result* (an Attr, an OpenResult, or a tuple/list holding them)
        with the change counters `flush` just raised: the body built it
        before the flush."""
        if isinstance(result, dict):
            if "change" in result and result.get("ino") in self.changed:
                result["change"] = self.changed[result["ino"]]
            for key in ("attr", "parent_attr"):
                if isinstance(result.get(key), dict):
                    self.stamped(result[key])
        elif isinstance(result, (tuple, list)):
            for item in result:
                self.stamped(item)
        return result

    # ---- directory entries -------------------------------------------------

    def entry(self, parent: int, name: bytes) -> int | None:
        raw = self.get_raw(DB_DENTRIES, dentry_key(parent, name))
        return None if raw is None else dentry_child(raw)

    def put_entry(self, parent: int, name: bytes, ino: int, mode: int) -> None:
        self.put(DB_DENTRIES, dentry_key(parent, name), dentry_value(ino, mode))

    def remove_entry(self, parent: int, name: bytes) -> None:
        self.delete(DB_DENTRIES, dentry_key(parent, name))

    def is_empty(self, ino: int) -> bool:
        return not self.has_prefix(DB_DENTRIES, u64(ino))

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        """Is *ancestor* the directory *ino* itself or above it?"""
        for _ in range(1 << 20):
            if ino == ancestor:
                return True
            if ino == ROOT_INODE:
                return False
            ino = self.inode(ino)["parent"]
        raise FsError(errno.EIO, "directory parent chain does not reach the root")


# what commits changed: ({file: change}, {directory: change}, {directory: its one changer})
Changed = tuple[dict[int, int], dict[int, int], dict[int, int | None]]


def merge_dirs(
    into: dict[int, int],
    into_by: dict[int, int | None],
    dirs: dict[int, int],
    by: dict[int, int | None],
) -> None:
    """Add directory changes (*dirs*, each made by session *by*[ino]; None:
    not named) to *into*, keeping in *into_by* (the same keys) each
    directory's one changer: a directory changed by two sessions, or by one
    not named, has None."""
    for ino, change in dirs.items():
        changer = by.get(ino)
        into_by[ino] = changer if ino not in into or into_by[ino] == changer else None
        into[ino] = change


class _Group:
    """The outer transaction of a group commit (begun by the first mutation
    that writes: a group of calls that only read takes none), and what must
    follow its fate."""

    def __init__(self) -> None:
        self.txn: Any = None
        self.ended: list[Callable[[bool], None]] = []
        self.ops: list[Op] = []  # of the mutations that succeeded, in order
        self.changed_files: dict[int, int] = {}  # of the mutations that succeeded
        self.changed_dirs: dict[int, int] = {}
        self.dirs_by: dict[int, int | None] = {}  # directory -> its one changer (`merge_dirs`)


class Transactions:
    """Opens and commits the namespace's LMDB transactions.

    `write` is where every write transaction begins and commits; `group`
    runs several mutations in one LMDB write transaction with one commit
    (one fsync), each `write` of theirs in a nested transaction, so one that
    fails is rolled back alone. It is also the place for handing each
    committed transaction to a replication log. LMDB ties a write
    transaction to its thread, so a body must not block on anything else
    (the server runs each group in one worker-thread call: `Writer`).
    """

    def __init__(self, env: Any, dbs: dict[bytes, Any]) -> None:
        self.env = env
        self.dbs = dbs
        self.read_only = ReadOnlyHandles()
        self.log = ReplicationLog(dbs)
        # Every committed write transaction that changed something becomes a
        # log entry of this epoch (off until the store has formatted itself:
        # each server formats its own `info`); `last_seq` is the newest.
        self.logging = False
        self.epoch = 0
        with env.begin(write=False) as txn:
            self.last_seq = self.log.position(txn).applied_seq
        # LMDB write transactions begun and committed (a group is one): read-only
        # work must move neither
        self.write_count = 0
        self.commit_count = 0
        self._local = threading.local()  # .group: the group open in this thread
        # {ino: change} of regular files and of directories changed by commits
        # since the last `take_changed` (what cache watches tell clients:
        # cache_watch.py)
        self._changed_files: dict[int, int] = {}
        self._changed_dirs: dict[int, int] = {}
        self._dirs_by: dict[int, int | None] = {}
        self._changed_lock = threading.Lock()

    def group(self, calls: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        """Run *calls* (each a mutation: checks, then its `write`) in one
        write transaction, each `write` nested, and commit once. Returns
        (True, result) or (False, exception) per call, in order; if the
        commit itself fails, every call fails with its error (none is
        applied)."""
        group = _Group()
        self._local.group = group
        committed = False
        try:
            results: list[tuple[bool, Any]] = []
            for call in calls:
                try:
                    results.append((True, call()))
                except Exception as exc:
                    results.append((False, exc))
            if group.txn is not None:
                seq = self._log_entry(group.txn, group.ops)
                group.txn.commit()
                self.commit_count += 1
                self.last_seq = seq
                self._cached_committed(group.changed_files, group.changed_dirs, group.dirs_by)
            committed = True
            return results
        except lmdb.MapFullError:
            group.txn.abort()
            full = FsError(errno.ENOSPC, "metadata store is full (raise map_size)")
            return [(False, full) for _ in calls]
        except BaseException:
            if group.txn is not None:
                group.txn.abort()
            raise
        finally:
            self._local.group = None
            for fn in group.ended:
                fn(committed)

    def _nested(self, group: _Group, body: Callable[[Tx], T]) -> T:
        """One mutation inside a group: its own child transaction, merged
        into the group's on success, rolled back alone on failure."""
        if group.txn is None:
            self.write_count += 1
            group.txn = self.env.begin(write=True)
        tx: Tx | None = None
        try:
            with self.env.begin(write=True, parent=group.txn) as txn:
                tx = Tx(txn, self.dbs, self.read_only)
                result = body(tx)
                tx.flush()
                result = tx.stamped(result)
        except BaseException as exc:
            for fn in tx.ended if tx is not None else []:
                fn(False)
            if isinstance(exc, lmdb.MapFullError):
                raise FsError(errno.ENOSPC, "metadata store is full (raise map_size)") from None
            raise
        assert tx is not None
        group.ended.extend(tx.ended)  # they follow the group's commit
        group.ops.extend(tx.ops)
        group.changed_files.update(tx.changed_files)
        merge_dirs(group.changed_dirs, group.dirs_by, tx.changed_dirs, tx.changed_by())
        return result

    def _log_entry(self, txn: Any, ops: list[Op]) -> int:
        """Record *ops* as the next log entry in *txn* (before its commit);
        returns the newest seq."""
        if not self.logging or not ops:
            return self.last_seq
        return self.log.append(txn, self.epoch, ops)

    def reopen(self, env: Any, dbs: dict[bytes, Any]) -> None:
        """Work on a reopened environment (a snapshot was installed)."""
        self.read_only.following = True
        self.env, self.dbs = env, dbs
        self.log = ReplicationLog(dbs)
        self.last_seq = self.position().applied_seq

    def position(self) -> Position:
        with self.env.begin(write=False) as txn:
            return self.log.position(txn)

    def apply_entries(self, entries: list[list[Any]], epoch: int) -> Position:
        """On a follower: apply log entries `[seq, epoch, ops]` (each the
        next one) and remember *epoch* as seen, in one durable commit."""
        self.write_count += 1
        self.read_only.following = True
        with self.env.begin(write=True) as txn:
            self.log.raise_epoch(txn, epoch)
            for seq, entry_epoch, ops in entries:
                self.log.apply(txn, seq, entry_epoch, ops)
            position = self.log.position(txn)
        self.commit_count += 1
        self.last_seq = position.applied_seq
        return position

    def raise_epoch(self, epoch: int) -> None:
        with self.env.begin(write=True) as txn:
            self.log.raise_epoch(txn, epoch)

    def trim_log(self, through: int) -> int:
        with self.env.begin(write=True) as txn:
            return self.log.trim(txn, through)

    def write(self, body: Callable[[Tx], T]) -> T:
        """Run *body* in one write transaction: all of it commits, or nothing.
        Inside a `group`, in a nested transaction of the group's."""
        group: _Group | None = getattr(self._local, "group", None)
        if group is not None:
            return self._nested(group, body)
        self.write_count += 1
        tx: Tx | None = None
        committed = False
        try:
            with self.env.begin(write=True) as txn:
                tx = Tx(txn, self.dbs, self.read_only)
                result = body(tx)
                tx.flush()
                result = tx.stamped(result)
                seq = self._log_entry(txn, tx.ops)
            committed = True
            self.commit_count += 1
            self.last_seq = seq
            self._cached_committed(tx.changed_files, tx.changed_dirs, tx.changed_by())
            return result
        except lmdb.MapFullError:
            raise FsError(errno.ENOSPC, "metadata store is full (raise map_size)") from None
        finally:
            if tx is not None:
                for fn in tx.ended:
                    fn(committed)

    def _cached_committed(
        self, files: dict[int, int], dirs: dict[int, int], by: dict[int, int | None]
    ) -> None:
        if files or dirs:
            with self._changed_lock:
                self._changed_files.update(files)
                merge_dirs(self._changed_dirs, self._dirs_by, dirs, by)

    def take_changed(self) -> Changed:
        """{ino: change} of the regular files, and of the directories,
        committed changes have changed since the last call; and for each
        such directory the one session that changed it (None: several, or
        one not named)."""
        with self._changed_lock:
            files, self._changed_files = self._changed_files, {}
            dirs, self._changed_dirs = self._changed_dirs, {}
            by, self._dirs_by = self._dirs_by, {}
        return files, dirs, by

    def read(self, body: Callable[[Tx], T]) -> T:
        """Run *body* on one read snapshot (it never waits for the writer)."""
        with self.env.begin(write=False) as txn:
            return body(Tx(txn, self.dbs, self.read_only))
