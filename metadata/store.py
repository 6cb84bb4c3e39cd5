"""The namespace on LMDB: inodes, directory entries, xattrs, sessions, handles,
deferred deletes.

Every mutation is exactly one LMDB write transaction, so a process killed at
any instant leaves either the whole operation or none of it; there is no
recovery pass to get wrong. The API is synchronous on purpose: the server runs
each mutation in one worker-thread call, so the transaction begins and commits
in the same thread and an fsync never stalls the event loop.

Nothing here touches the network. What a mutation owes the storage daemons
(chunks to delete, chunks to cut) is recorded as a job in the same
transaction; `metadata.gc` carries the jobs out and deletes them afterwards.

Record formats and the reasoning behind them are in docs/metadata.md.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import lmdb
import msgpack

from shufflefs.metadata.protocol import (
    NAME_MAX,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INODE,
    SESSION_EXPIRED,
    SYMLINK_MAX,
    XATTR_CREATE,
    XATTR_NAME_MAX,
    XATTR_REPLACE,
    XATTR_SIZE_MAX,
    Attr,
    FsStats,
    Layout,
    OpenResult,
    ReaddirPage,
    Session,
)
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metadata.store")

T = TypeVar("T")
Rec = dict[str, Any]
LayoutSource = Callable[[], Layout]

FORMAT_VERSION = 1
U64 = struct.Struct(">Q")
DENTRY_VALUE = struct.Struct(">QB")  # child inode, file type (S_IFMT >> 12)
U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
ID32_MAX = (1 << 32) - 1  # uid, gid

MAX_CHUNKS = 1 << 32  # chunk indexes are 32-bit (storage chunk ids)
MAXSYMLINKS = 40  # as Linux
PATH_MAX = 4096
XATTR_LIST_MAX = 65536  # as Linux: the names of one inode, NUL-terminated, fit in this
READDIR_MAX = 1024  # entries per page: keeps a reply far below the frame body limit
SESSION_FIELD_MAX = 256
DOTS = (b".", b"..")
XATTR_PREFIXES = (b"user.", b"trusted.", b"security.", b"system.")
ACL_PREFIX = b"system.posix_acl_"
# A rough cost of one inode (record, dentry, tree overhead) for statfs's free-inode estimate.
INODE_COST = 512

# sub-database names
DB_INFO = b"info"
DB_INODES = b"inodes"
DB_DENTRIES = b"dentries"
DB_XATTRS = b"xattrs"
DB_SESSIONS = b"sessions"
DB_HANDLES = b"handles"
DB_SESSION_HANDLES = b"session_handles"
DB_GC = b"gc"
DB_TRUNCATES = b"truncates"
DB_COUNTERS = b"counters"
ALL_DBS = (
    DB_INFO,
    DB_INODES,
    DB_DENTRIES,
    DB_XATTRS,
    DB_SESSIONS,
    DB_HANDLES,
    DB_SESSION_HANDLES,
    DB_GC,
    DB_TRUNCATES,
    DB_COUNTERS,
)

# counter keys: the next id to hand out
C_INO = b"ino"
C_HANDLE = b"handle"
C_SESSION = b"session"
C_JOB = b"job"


class GcJob(TypedDict):
    ino: int
    layout: Layout
    queued: int  # ns


class TruncateJob(TypedDict):
    ino: int
    size: int  # cut the file's chunks to this size
    layout: Layout
    seq: int  # a newer job for the same inode has a higher seq
    queued: int  # ns


class ExpiredSession(TypedDict):
    session: int
    client: str
    host: str
    pid: int
    handles: int  # handles it still held
    freed: int  # inodes freed because this was their last handle


def u64(n: int) -> bytes:
    return U64.pack(n)


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True)


def file_type(mode: int) -> int:
    return stat.S_IFMT(mode) >> 12


def is_dir(rec: Rec) -> bool:
    return stat.S_ISDIR(rec["mode"])


def is_reg(rec: Rec) -> bool:
    return stat.S_ISREG(rec["mode"])


def is_lnk(rec: Rec) -> bool:
    return stat.S_ISLNK(rec["mode"])


def attr_of(ino: int, rec: Rec) -> Attr:
    return {
        "ino": ino,
        "mode": rec["mode"],
        "nlink": rec["nlink"],
        "uid": rec["uid"],
        "gid": rec["gid"],
        "rdev": rec["rdev"],
        "size": rec["size"],
        "atime": rec["atime"],
        "mtime": rec["mtime"],
        "ctime": rec["ctime"],
        "parent": rec["parent"] if is_dir(rec) else 0,
    }


def _layout_of(rec: Rec) -> Layout | None:
    layout = rec.get("layout")
    if layout is None:
        return None
    return {"chunk_size": layout["chunk_size"], "chains": list(layout["chains"])}


def max_file_size(layout: Layout) -> int:
    return layout["chunk_size"] * MAX_CHUNKS


# ---- argument checks (everything a peer sends is checked before use) -------


def check_ino(ino: int, what: str = "inode") -> None:
    if not 0 < ino <= U64_MAX:
        raise FsError(errno.EINVAL, f"invalid {what} number {ino}")


def check_name(name: bytes) -> None:
    if not name or b"/" in name or b"\0" in name:
        raise FsError(errno.EINVAL, f"invalid name {name[:64]!r}")
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name of {len(name)} bytes is longer than {NAME_MAX}")


def _check_id(value: int, what: str) -> None:
    if not 0 <= value <= ID32_MAX:
        raise FsError(errno.EINVAL, f"invalid {what} {value}")


def _check_time(value: int, what: str) -> None:
    if not I64_MIN <= value <= I64_MAX:
        raise FsError(errno.EINVAL, f"{what} {value} out of range")


def _check_mode(mode: int) -> None:
    if not 0 <= mode <= 0xFFFFFFFF:
        raise FsError(errno.EINVAL, f"invalid mode {mode}")


def _check_xattr_name(name: bytes) -> None:
    """Linux's order: length (ERANGE), then the namespace (EOPNOTSUPP)."""
    if not name or len(name) > XATTR_NAME_MAX:
        raise FsError(errno.ERANGE, f"xattr name of {len(name)} bytes (1..{XATTR_NAME_MAX})")
    if b"\0" in name:
        raise FsError(errno.EINVAL, "xattr name contains NUL")
    prefix = next((p for p in XATTR_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        raise FsError(errno.EOPNOTSUPP, f"xattr namespace of {name[:64]!r} not supported")
    if name == prefix:
        raise FsError(errno.EINVAL, f"xattr name {name!r} is only a namespace")
    if name.startswith(ACL_PREFIX):
        raise FsError(errno.EOPNOTSUPP, "POSIX ACLs are not supported")


def _path_components(path: bytes) -> list[bytes]:
    """Components of *path*, reversed (a stack). A trailing slash becomes a
    final '.', which demands a directory just as Linux does."""
    parts = [p for p in path.split(b"/") if p]
    if path.endswith(b"/") and parts:
        parts.append(b".")
    parts.reverse()
    return parts


class _Tx:
    """One transaction's view of the namespace, with a record cache.

    Records are loaded once per transaction and written back at the end only
    if they changed, so an operation that touches the same inode twice (a
    rename within one directory) can never write a stale copy over a fresh one.
    """

    def __init__(self, ns: Namespace, txn: Any) -> None:
        self.ns = ns
        self.txn = txn
        self.now = time.time_ns()
        self._recs: dict[int, Rec | None] = {}
        self._raw: dict[int, bytes | None] = {}

    # ---- inodes --------------------------------------------------------

    def get(self, ino: int) -> Rec | None:
        if ino in self._recs:
            return self._recs[ino]
        raw = self.txn.get(u64(ino), db=self.ns.dbs[DB_INODES])
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

    def flush(self) -> None:
        db = self.ns.dbs[DB_INODES]
        for ino, rec in self._recs.items():
            old = self._raw.get(ino)
            if rec is None:
                if old is not None:
                    self.txn.delete(u64(ino), db=db)
                continue
            raw = pack(rec)
            if raw != old:
                self.txn.put(u64(ino), raw, db=db)

    def touch_dir(self, rec: Rec) -> None:
        rec["mtime"] = rec["ctime"] = self.now

    def next_id(self, counter: bytes) -> int:
        db = self.ns.dbs[DB_COUNTERS]
        raw = self.txn.get(counter, db=db)
        value = U64.unpack(raw)[0] if raw is not None else 1
        self.txn.put(counter, u64(value + 1), db=db)
        return int(value)

    # ---- directory entries ---------------------------------------------

    def entry(self, parent: int, name: bytes) -> int | None:
        raw = self.txn.get(u64(parent) + name, db=self.ns.dbs[DB_DENTRIES])
        return None if raw is None else int(DENTRY_VALUE.unpack(raw)[0])

    def put_entry(self, parent: int, name: bytes, ino: int, mode: int) -> None:
        self.txn.put(
            u64(parent) + name, DENTRY_VALUE.pack(ino, file_type(mode)), db=self.ns.dbs[DB_DENTRIES]
        )

    def remove_entry(self, parent: int, name: bytes) -> None:
        self.txn.delete(u64(parent) + name, db=self.ns.dbs[DB_DENTRIES])

    def is_empty(self, ino: int) -> bool:
        return not self._has_prefix(DB_DENTRIES, u64(ino))

    def _has_prefix(self, db: bytes, prefix: bytes) -> bool:
        cur = self.txn.cursor(db=self.ns.dbs[db])
        return bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)

    def prefix_items(
        self, db: bytes, prefix: bytes, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Items whose key starts with *prefix*, from key *start* on."""
        cur = self.txn.cursor(db=self.ns.dbs[db])
        if not cur.set_range(prefix if start is None else start):
            return
        for key, value in cur.iternext():
            if not key.startswith(prefix):
                return
            yield bytes(key), bytes(value)

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        """Is *ancestor* the directory *ino* itself or above it?"""
        for _ in range(1 << 20):
            if ino == ancestor:
                return True
            if ino == ROOT_INODE:
                return False
            ino = self.inode(ino)["parent"]
        raise FsError(errno.EIO, "directory parent chain does not reach the root")

    # ---- lifetime --------------------------------------------------------

    def has_handles(self, ino: int) -> bool:
        return self._has_prefix(DB_HANDLES, u64(ino))

    def drop_name(self, parent_rec: Rec, ino: int, rec: Rec) -> bool:
        """One name of *ino* is gone (unlink, rmdir, replaced by rename).
        Returns whether the inode was freed."""
        if is_dir(rec):
            rec["nlink"] = 0
            parent_rec["nlink"] -= 1
        else:
            rec["nlink"] -= 1
        rec["ctime"] = self.now
        return rec["nlink"] == 0 and self.free_if_unused(ino, rec)

    def free_if_unused(self, ino: int, rec: Rec) -> bool:
        """Free an inode that has no name left, unless a handle holds it."""
        if rec["nlink"] > 0 or self.has_handles(ino):
            return False
        self._recs[ino] = None
        for key, _ in list(self.prefix_items(DB_XATTRS, u64(ino))):
            self.txn.delete(key, db=self.ns.dbs[DB_XATTRS])
        self.txn.delete(u64(ino), db=self.ns.dbs[DB_TRUNCATES])
        layout = rec.get("layout")
        if layout is not None:
            job = {"layout": layout, "queued": self.now}
            self.txn.put(u64(ino), pack(job), db=self.ns.dbs[DB_GC])
        return True

    def record_truncate(self, ino: int, rec: Rec, size: int) -> None:
        """Owe the storage daemons a cut of *ino* to *size*. A job still
        pending from an earlier shrink keeps the smaller size, so bytes past
        either cut can never come back."""
        db = self.ns.dbs[DB_TRUNCATES]
        old = self.txn.get(u64(ino), db=db)
        if old is not None:
            size = min(size, int(unpack(old)["size"]))
        seq = self.next_id(C_JOB)
        job = {"size": size, "layout": rec["layout"], "seq": seq, "queued": self.now}
        self.txn.put(u64(ino), pack(job), db=db)

    def set_size(self, ino: int, rec: Rec, size: int) -> None:
        if size < rec["size"]:
            self.record_truncate(ino, rec, size)
        rec["size"] = size

    # ---- sessions and handles ----------------------------------------------

    def session(self, session: int) -> Rec | None:
        if not 0 < session <= U64_MAX:
            return None
        raw = self.txn.get(u64(session), db=self.ns.dbs[DB_SESSIONS])
        return None if raw is None else dict(unpack(raw))

    def live_session(self, session: int) -> Rec:
        rec = self.session(session)
        if rec is None or rec["expires"] < self.ns.clock():
            raise FsError(
                SESSION_EXPIRED, f"session {session} is unknown or expired; open a new session"
            )
        return rec

    def add_handle(self, ino: int, session: int) -> int:
        handle = self.next_id(C_HANDLE)
        self.txn.put(u64(ino) + u64(handle), u64(session), db=self.ns.dbs[DB_HANDLES])
        self.txn.put(u64(session) + u64(handle), u64(ino), db=self.ns.dbs[DB_SESSION_HANDLES])
        return handle

    def close_session(self, session: int) -> tuple[int, int]:
        """Drop a session and its handles; returns (handles, inodes freed)."""
        handles = list(self.prefix_items(DB_SESSION_HANDLES, u64(session)))
        inos = set()
        for key, value in handles:
            handle = key[8:]
            self.txn.delete(key, db=self.ns.dbs[DB_SESSION_HANDLES])
            self.txn.delete(value + handle, db=self.ns.dbs[DB_HANDLES])
            inos.add(U64.unpack(value)[0])
        self.txn.delete(u64(session), db=self.ns.dbs[DB_SESSIONS])
        freed = 0
        for ino in sorted(inos):
            rec = self.get(ino)
            if rec is not None and rec["nlink"] == 0 and self.free_if_unused(ino, rec):
                freed += 1
        return len(handles), freed


class Namespace:
    """The namespace of one metadata server, in one LMDB environment."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 64 << 30,
        sync: bool = True,
        session_timeout: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.session_timeout = session_timeout
        self.clock = clock  # wall clock: session leases outlive a restart
        self.env = lmdb.open(
            str(self.path),
            subdir=True,
            map_size=map_size,
            max_dbs=len(ALL_DBS) + 2,
            sync=sync,
            metasync=sync,
            max_readers=256,
        )
        self.dbs: dict[bytes, Any] = {name: self.env.open_db(name) for name in ALL_DBS}
        self._format()

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _format(self) -> None:
        """Create the root on first open; refuse a namespace of another format."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"format", db=self.dbs[DB_INFO])
            if raw is not None:
                version = U64.unpack(raw)[0]
                if version != FORMAT_VERSION:
                    raise FsError(
                        errno.EINVAL,
                        f"namespace at {self.path} has format {version}, "
                        f"this server reads {FORMAT_VERSION}",
                    )
                return
            now = time.time_ns()
            root = {
                "mode": stat.S_IFDIR | 0o755,
                "nlink": 2,
                "uid": 0,
                "gid": 0,
                "rdev": 0,
                "size": 0,
                "atime": now,
                "mtime": now,
                "ctime": now,
                "parent": ROOT_INODE,
            }
            txn.put(u64(ROOT_INODE), pack(root), db=self.dbs[DB_INODES])
            txn.put(C_INO, u64(ROOT_INODE + 1), db=self.dbs[DB_COUNTERS])
            txn.put(b"format", u64(FORMAT_VERSION), db=self.dbs[DB_INFO])
            txn.put(b"created", u64(now), db=self.dbs[DB_INFO])
        log.info("created a new namespace at %s", self.path)

    # ---- transactions ------------------------------------------------------

    def _write(self, fn: Callable[[_Tx], T]) -> T:
        """Run *fn* in one write transaction: all of it commits, or nothing."""
        try:
            with self.env.begin(write=True) as txn:
                tx = _Tx(self, txn)
                result = fn(tx)
                tx.flush()
            return result
        except lmdb.MapFullError:
            raise FsError(errno.ENOSPC, "metadata store is full (raise map_size)") from None

    def _read(self, fn: Callable[[_Tx], T]) -> T:
        with self.env.begin(write=False) as txn:
            return fn(_Tx(self, txn))

    # ---- sessions ------------------------------------------------------------

    def session_open(self, client: str, host: str, pid: int) -> Session:
        for what, value in (("client", client), ("host", host)):
            if len(value) > SESSION_FIELD_MAX:
                raise FsError(errno.EINVAL, f"session {what} longer than {SESSION_FIELD_MAX}")
        if not 0 <= pid <= ID32_MAX:
            raise FsError(errno.EINVAL, f"invalid pid {pid}")

        def op(tx: _Tx) -> Session:
            session = tx.next_id(C_SESSION)
            now = self.clock()
            rec = {
                "client": client,
                "host": host,
                "pid": pid,
                "created": now,
                "expires": now + self.session_timeout,
            }
            tx.txn.put(u64(session), pack(rec), db=self.dbs[DB_SESSIONS])
            return {"session": session, "lease": self.session_timeout}

        return self._write(op)

    def session_renew(self, session: int) -> None:
        def op(tx: _Tx) -> None:
            rec = tx.session(session)
            if rec is None or rec["expires"] < self.clock():
                raise FsError(errno.ENOENT, f"session {session} is unknown or expired")
            rec["expires"] = self.clock() + self.session_timeout
            tx.txn.put(u64(session), pack(rec), db=self.dbs[DB_SESSIONS])

        self._write(op)

    def session_close(self, session: int) -> tuple[int, int]:
        """Close a session (unknown: nothing to do). Returns (handles, freed)."""

        def op(tx: _Tx) -> tuple[int, int]:
            if tx.session(session) is None:
                return 0, 0
            return tx.close_session(session)

        return self._write(op)

    def reap_sessions(self) -> list[ExpiredSession]:
        """Close every session whose lease ran out. Looks in a read
        transaction first: the reaper runs often, and a write transaction
        that changes nothing is not worth its lock."""

        def expired_sessions(tx: _Tx) -> list[tuple[int, Rec]]:
            now = self.clock()
            expired = []
            for key, raw in tx.prefix_items(DB_SESSIONS, b""):
                rec = unpack(raw)
                if rec["expires"] < now:
                    expired.append((int(U64.unpack(key)[0]), rec))
            return expired

        if not self._read(expired_sessions):
            return []

        def op(tx: _Tx) -> list[ExpiredSession]:
            expired = expired_sessions(tx)
            out: list[ExpiredSession] = []
            for session, rec in expired:
                handles, freed = tx.close_session(session)
                out.append(
                    {
                        "session": session,
                        "client": rec["client"],
                        "host": rec["host"],
                        "pid": rec["pid"],
                        "handles": handles,
                        "freed": freed,
                    }
                )
            return out

        return self._write(op)

    def restart_leases(self) -> int:
        """Give every session a full lease again: after the server was down,
        clients could not renew, and that is no reason to close their files."""

        def op(tx: _Tx) -> int:
            expires = self.clock() + self.session_timeout
            items = list(tx.prefix_items(DB_SESSIONS, b""))
            for key, raw in items:
                rec = unpack(raw)
                rec["expires"] = expires
                tx.txn.put(key, pack(rec), db=self.dbs[DB_SESSIONS])
            return len(items)

        return self._write(op)

    # ---- names and attributes ----------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        check_name(name)

        def op(tx: _Tx) -> Attr:
            rec = tx.directory(parent)
            if name == b".":
                return attr_of(parent, rec)
            if name == b"..":
                return attr_of(rec["parent"], tx.inode(rec["parent"]))
            ino = tx.entry(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT, f"no entry {name[:64]!r} in directory {parent}")
            return attr_of(ino, tx.inode(ino))

        return self._read(op)

    def getattr(self, ino: int) -> Attr:
        return self._read(lambda tx: attr_of(ino, tx.inode(ino)))

    def resolve(self, path: bytes, follow: bool = True) -> Attr:
        if not path:
            raise FsError(errno.ENOENT, "empty path")
        if not path.startswith(b"/"):
            raise FsError(errno.EINVAL, f"path {path[:64]!r} is not absolute")
        if len(path) >= PATH_MAX:
            raise FsError(errno.ENAMETOOLONG, f"path of {len(path)} bytes")
        if b"\0" in path:
            raise FsError(errno.EINVAL, "path contains NUL")

        def op(tx: _Tx) -> Attr:
            stack = _path_components(path)
            cur = ROOT_INODE
            links = 0
            while stack:
                comp = stack.pop()
                rec = tx.inode(cur)
                if not is_dir(rec):
                    raise FsError(errno.ENOTDIR, f"inode {cur} in the path is not a directory")
                if comp == b".":
                    continue
                if comp == b"..":
                    cur = rec["parent"]
                    continue
                if len(comp) > NAME_MAX:
                    raise FsError(errno.ENAMETOOLONG, f"path component of {len(comp)} bytes")
                child = tx.entry(cur, comp)
                if child is None:
                    raise FsError(errno.ENOENT, f"no entry {comp[:64]!r} in directory {cur}")
                crec = tx.inode(child)
                if is_lnk(crec) and (stack or follow):
                    links += 1
                    if links > MAXSYMLINKS:
                        raise FsError(errno.ELOOP, f"more than {MAXSYMLINKS} symbolic links")
                    target: bytes = crec["target"]
                    if target.startswith(b"/"):
                        cur = ROOT_INODE
                    stack.extend(_path_components(target))
                    continue
                cur = child
            return attr_of(cur, tx.inode(cur))

        return self._read(op)

    def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime: int | None = None,
        mtime: int | None = None,
    ) -> Attr:
        """A shrink records a truncate job in the same transaction (see
        `truncate_job`); a size change alone sets mtime to now, as truncate(2)."""
        if mode is not None:
            _check_mode(mode)
        if uid is not None:
            _check_id(uid, "uid")
        if gid is not None:
            _check_id(gid, "gid")
        if size is not None and size < 0:
            raise FsError(errno.EINVAL, f"negative size {size}")
        if atime is not None:
            _check_time(atime, "atime")
        if mtime is not None:
            _check_time(mtime, "mtime")

        def op(tx: _Tx) -> Attr:
            rec = tx.inode(ino)
            if size is not None:
                if is_dir(rec):
                    raise FsError(errno.EISDIR, f"inode {ino} is a directory")
                if not is_reg(rec):
                    raise FsError(errno.EINVAL, f"inode {ino} is not a regular file")
                if size > max_file_size(rec["layout"]):
                    raise FsError(errno.EFBIG, f"size {size} beyond the file's chunk index limit")
                tx.set_size(ino, rec, size)
                rec["mtime"] = tx.now
            if mode is not None:
                rec["mode"] = stat.S_IFMT(rec["mode"]) | (mode & 0o7777)
            if uid is not None:
                rec["uid"] = uid
            if gid is not None:
                rec["gid"] = gid
            if atime is not None:
                rec["atime"] = atime
            if mtime is not None:
                rec["mtime"] = mtime
            rec["ctime"] = tx.now
            return attr_of(ino, rec)

        return self._write(op)

    def update_length(self, ino: int, length: int, mtime: int | None = None) -> Attr:
        if length < 0:
            raise FsError(errno.EINVAL, f"negative length {length}")
        if mtime is not None:
            _check_time(mtime, "mtime")

        def op(tx: _Tx) -> Attr:
            rec = tx.inode(ino)
            if is_dir(rec):
                raise FsError(errno.EISDIR, f"inode {ino} is a directory")
            if not is_reg(rec):
                raise FsError(errno.EINVAL, f"inode {ino} is not a regular file")
            if length > max_file_size(rec["layout"]):
                raise FsError(errno.EFBIG, f"length {length} beyond the file's chunk index limit")
            rec["size"] = max(rec["size"], length)
            if mtime is not None:
                rec["mtime"] = rec["ctime"] = mtime
            return attr_of(ino, rec)

        return self._write(op)

    # ---- creating ------------------------------------------------------------

    def _new_inode(
        self, tx: _Tx, parent: int, name: bytes, mode: int, uid: int, gid: int, **extra: Any
    ) -> tuple[int, Rec]:
        """Create an inode under a fresh name. A set-group-ID directory hands
        its group to everything created in it and its S_ISGID to subdirectories."""
        prec = tx.live_directory(parent)
        if tx.entry(parent, name) is not None:
            raise FsError(errno.EEXIST, f"{name[:64]!r} exists in directory {parent}")
        if prec["mode"] & stat.S_ISGID:
            gid = prec["gid"]
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        ino = tx.next_id(C_INO)
        rec: Rec = {
            "mode": mode,
            "nlink": 2 if stat.S_ISDIR(mode) else 1,
            "uid": uid,
            "gid": gid,
            "rdev": 0,
            "size": 0,
            "atime": tx.now,
            "mtime": tx.now,
            "ctime": tx.now,
            "parent": parent if stat.S_ISDIR(mode) else 0,
        }
        rec.update(extra)
        tx.add_inode(ino, rec)
        tx.put_entry(parent, name, ino, mode)
        if stat.S_ISDIR(mode):
            prec["nlink"] += 1
        tx.touch_dir(prec)
        return ino, rec

    @staticmethod
    def _new_name(name: bytes) -> None:
        check_name(name)
        if name in DOTS:
            raise FsError(errno.EEXIST, f"{name!r} always exists")

    def mknod(
        self,
        parent: int,
        name: bytes,
        mode: int,
        rdev: int,
        uid: int,
        gid: int,
        layout: LayoutSource,
    ) -> Attr:
        """*layout* is called only if a regular file is really created."""
        self._new_name(name)
        _check_mode(mode)
        _check_id(uid, "uid")
        _check_id(gid, "gid")
        if not 0 <= rdev <= U64_MAX:
            raise FsError(errno.EINVAL, f"invalid rdev {rdev}")
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind == stat.S_IFDIR:
            raise FsError(errno.EPERM, "mknod cannot create a directory (use mkdir)")
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise FsError(errno.EINVAL, f"mknod cannot create file type {kind:o}")

        def op(tx: _Tx) -> Attr:
            extra: dict[str, Any] = {}
            if kind in (stat.S_IFCHR, stat.S_IFBLK):
                extra["rdev"] = rdev
            if kind == stat.S_IFREG:
                tx.live_directory(parent)  # no layout for a create that cannot happen
                if tx.entry(parent, name) is None:
                    extra["layout"] = layout()
            ino, rec = self._new_inode(tx, parent, name, kind | (mode & 0o7777), uid, gid, **extra)
            return attr_of(ino, rec)

        return self._write(op)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        self._new_name(name)
        _check_mode(mode)
        _check_id(uid, "uid")
        _check_id(gid, "gid")

        def op(tx: _Tx) -> Attr:
            ino, rec = self._new_inode(tx, parent, name, stat.S_IFDIR | (mode & 0o1777), uid, gid)
            return attr_of(ino, rec)

        return self._write(op)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        self._new_name(name)
        _check_id(uid, "uid")
        _check_id(gid, "gid")
        if not target:
            raise FsError(errno.ENOENT, "empty symlink target")
        if len(target) > SYMLINK_MAX:
            raise FsError(errno.ENAMETOOLONG, f"symlink target of {len(target)} bytes")
        if b"\0" in target:
            raise FsError(errno.EINVAL, "symlink target contains NUL")

        def op(tx: _Tx) -> Attr:
            ino, rec = self._new_inode(
                tx, parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target, size=len(target)
            )
            return attr_of(ino, rec)

        return self._write(op)

    def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        flags: int,
        uid: int,
        gid: int,
        session: int,
        layout: LayoutSource,
    ) -> OpenResult:
        """open(O_CREAT): an existing regular file is opened (EEXIST with
        O_EXCL), an existing directory is EISDIR, an existing symlink ELOOP
        (the caller resolves symlinks before it creates)."""
        check_name(name)
        _check_mode(mode)
        _check_id(uid, "uid")
        _check_id(gid, "gid")
        if name in DOTS:
            raise FsError(
                errno.EEXIST if flags & os.O_EXCL else errno.EISDIR, f"{name!r} is a directory"
            )

        def op(tx: _Tx) -> OpenResult:
            tx.live_session(session)
            tx.live_directory(parent)
            existing = tx.entry(parent, name)
            if existing is not None:
                if flags & os.O_EXCL:
                    raise FsError(errno.EEXIST, f"{name[:64]!r} exists in directory {parent}")
                return self._open(tx, existing, flags, session)
            ino, rec = self._new_inode(
                tx, parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid, layout=layout()
            )
            handle = tx.add_handle(ino, session)
            return {"attr": attr_of(ino, rec), "layout": _layout_of(rec), "handle": handle}

        return self._write(op)

    def open(self, ino: int, flags: int, session: int) -> OpenResult:
        def op(tx: _Tx) -> OpenResult:
            tx.live_session(session)
            return self._open(tx, ino, flags, session)

        return self._write(op)

    def _open(self, tx: _Tx, ino: int, flags: int, session: int) -> OpenResult:
        rec = tx.inode(ino)
        if is_dir(rec) and ((flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC):
            raise FsError(errno.EISDIR, f"inode {ino} is a directory")
        if is_lnk(rec):
            raise FsError(errno.ELOOP, f"inode {ino} is a symbolic link")
        if flags & os.O_TRUNC and is_reg(rec):
            tx.set_size(ino, rec, 0)
            rec["mtime"] = rec["ctime"] = tx.now
        handle = tx.add_handle(ino, session)
        return {"attr": attr_of(ino, rec), "layout": _layout_of(rec), "handle": handle}

    def release(self, ino: int, handle: int, session: int) -> bool:
        """Close a handle; releasing one already gone (its session expired) is
        not an error. Returns whether the inode was freed."""
        check_ino(ino)
        check_ino(handle, "handle")

        def op(tx: _Tx) -> bool:
            key = u64(ino) + u64(handle)
            owner = tx.txn.get(key, db=self.dbs[DB_HANDLES])
            if owner is None:
                return False
            if U64.unpack(owner)[0] != session:
                raise FsError(errno.EBADF, f"handle {handle} belongs to another session")
            tx.txn.delete(key, db=self.dbs[DB_HANDLES])
            tx.txn.delete(u64(session) + u64(handle), db=self.dbs[DB_SESSION_HANDLES])
            rec = tx.get(ino)
            return rec is not None and rec["nlink"] == 0 and tx.free_if_unused(ino, rec)

        return self._write(op)

    # ---- removing and renaming ----------------------------------------------

    def unlink(self, parent: int, name: bytes) -> bool:
        """Returns whether the inode was freed (it may have a GC job now)."""
        check_name(name)
        if name in DOTS:
            raise FsError(errno.EISDIR, f"{name!r} is a directory")

        def op(tx: _Tx) -> bool:
            prec = tx.directory(parent)
            ino = tx.entry(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT, f"no entry {name[:64]!r} in directory {parent}")
            rec = tx.inode(ino)
            if is_dir(rec):
                raise FsError(errno.EISDIR, f"{name[:64]!r} is a directory")
            tx.remove_entry(parent, name)
            tx.touch_dir(prec)
            return tx.drop_name(prec, ino, rec)

        return self._write(op)

    def rmdir(self, parent: int, name: bytes) -> bool:
        check_name(name)
        if name == b".":
            raise FsError(errno.EINVAL, "cannot remove '.'")
        if name == b"..":
            raise FsError(errno.ENOTEMPTY, "cannot remove '..'")

        def op(tx: _Tx) -> bool:
            prec = tx.directory(parent)
            ino = tx.entry(parent, name)
            if ino is None:
                raise FsError(errno.ENOENT, f"no entry {name[:64]!r} in directory {parent}")
            rec = tx.inode(ino)
            if not is_dir(rec):
                raise FsError(errno.ENOTDIR, f"{name[:64]!r} is not a directory")
            if not tx.is_empty(ino):
                raise FsError(errno.ENOTEMPTY, f"directory {name[:64]!r} is not empty")
            tx.remove_entry(parent, name)
            tx.touch_dir(prec)
            return tx.drop_name(prec, ino, rec)

        return self._write(op)

    def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> bool:
        """renameat2(2), checked in the order Linux checks. Returns whether a
        replaced inode was freed."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or (
            flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL, f"invalid rename flags {flags}")
        check_name(name)
        check_name(new_name)
        if name in DOTS:
            raise FsError(errno.EBUSY, f"cannot rename {name!r}")
        if new_name in DOTS:
            raise FsError(
                errno.EEXIST if flags & RENAME_NOREPLACE else errno.EBUSY,
                f"cannot rename onto {new_name!r}",
            )
        exchange = bool(flags & RENAME_EXCHANGE)

        def op(tx: _Tx) -> bool:
            prec = tx.directory(parent)
            nprec = tx.directory(new_parent)
            src = tx.entry(parent, name)
            if src is None:
                raise FsError(errno.ENOENT, f"no entry {name[:64]!r} in directory {parent}")
            if nprec["nlink"] == 0:
                raise FsError(errno.ENOENT, f"directory {new_parent} was removed")
            dst = tx.entry(new_parent, new_name)
            if dst is None and exchange:
                raise FsError(errno.ENOENT, f"no entry {new_name[:64]!r} to exchange with")
            if dst is not None and flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST, f"{new_name[:64]!r} exists")
            srec = tx.inode(src)
            drec = tx.inode(dst) if dst is not None else None
            if parent != new_parent:
                if is_dir(srec) and tx.is_ancestor(src, new_parent):
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                if drec is not None and dst is not None and tx.is_ancestor(dst, parent):
                    raise FsError(
                        errno.EINVAL if exchange else errno.ENOTEMPTY,
                        "the destination is an ancestor of the source",
                    )
            if src == dst:
                return False  # two names of one inode: rename(2) does nothing
            if exchange:
                assert dst is not None and drec is not None
                tx.put_entry(new_parent, new_name, src, srec["mode"])
                tx.put_entry(parent, name, dst, drec["mode"])
                if parent != new_parent:
                    if is_dir(srec):
                        srec["parent"] = new_parent
                        prec["nlink"] -= 1
                        nprec["nlink"] += 1
                    if is_dir(drec):
                        drec["parent"] = parent
                        nprec["nlink"] -= 1
                        prec["nlink"] += 1
                srec["ctime"] = drec["ctime"] = tx.now
                tx.touch_dir(prec)
                tx.touch_dir(nprec)
                return False
            if drec is not None and dst is not None:
                if is_dir(srec):
                    if not is_dir(drec):
                        raise FsError(errno.ENOTDIR, f"{new_name[:64]!r} is not a directory")
                    if not tx.is_empty(dst):
                        raise FsError(errno.ENOTEMPTY, f"directory {new_name[:64]!r} is not empty")
                elif is_dir(drec):
                    raise FsError(errno.EISDIR, f"{new_name[:64]!r} is a directory")
            tx.remove_entry(parent, name)
            freed = False
            if drec is not None and dst is not None:
                freed = tx.drop_name(nprec, dst, drec)
            tx.put_entry(new_parent, new_name, src, srec["mode"])
            if is_dir(srec) and parent != new_parent:
                prec["nlink"] -= 1
                nprec["nlink"] += 1
                srec["parent"] = new_parent
            srec["ctime"] = tx.now
            tx.touch_dir(prec)
            tx.touch_dir(nprec)
            return freed

        return self._write(op)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        self._new_name(new_name)

        def op(tx: _Tx) -> Attr:
            nprec = tx.live_directory(new_parent)
            rec = tx.inode(ino)
            if tx.entry(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST, f"{new_name[:64]!r} exists in directory {new_parent}")
            if is_dir(rec):
                raise FsError(errno.EPERM, "cannot hard-link a directory")
            if rec["nlink"] == 0:
                raise FsError(errno.ENOENT, f"inode {ino} was unlinked")
            tx.put_entry(new_parent, new_name, ino, rec["mode"])
            rec["nlink"] += 1
            rec["ctime"] = tx.now
            tx.touch_dir(nprec)
            return attr_of(ino, rec)

        return self._write(op)

    def readlink(self, ino: int) -> bytes:
        def op(tx: _Tx) -> bytes:
            rec = tx.inode(ino)
            if not is_lnk(rec):
                raise FsError(errno.EINVAL, f"inode {ino} is not a symbolic link")
            target: bytes = rec["target"]
            return target

        return self._read(op)

    def readdir(self, ino: int, after: bytes | None = None, limit: int = 256) -> ReaddirPage:
        """A page in name order after the name *after*: a cursor that is a
        name, not a position, cannot skip or repeat an entry when others come
        and go between pages."""
        if limit < 1:
            raise FsError(errno.EINVAL, f"readdir limit {limit} < 1")
        limit = min(limit, READDIR_MAX)
        if after is not None and len(after) > NAME_MAX:
            raise FsError(errno.EINVAL, "readdir cursor longer than a name")

        def op(tx: _Tx) -> ReaddirPage:
            tx.directory(ino)
            prefix = u64(ino)
            entries: list[tuple[bytes, Attr]] = []
            more = False
            for key, value in tx.prefix_items(DB_DENTRIES, prefix, prefix + (after or b"")):
                name = key[8:]
                if name == after:
                    continue
                if len(entries) == limit:
                    more = True
                    break
                child = int(DENTRY_VALUE.unpack(value)[0])
                rec = tx.get(child)
                if rec is None:
                    log.warning("dentry %r in directory %d points to missing inode", name, ino)
                    continue
                entries.append((name, attr_of(child, rec)))
            return {"entries": entries, "more": more}

        return self._read(op)

    def statfs(self) -> FsStats:
        with self.env.begin() as txn:
            files = int(txn.stat(self.dbs[DB_INODES])["entries"])
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        free = max(0, info["map_size"] - used)
        return {"files": files, "max_files": files + free // INODE_COST}

    # ---- extended attributes ----------------------------------------------

    @staticmethod
    def _xattr_allowed(rec: Rec, name: bytes) -> bool:
        """user.* lives on regular files and directories only (as Linux)."""
        return not name.startswith(b"user.") or is_reg(rec) or is_dir(rec)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        _check_xattr_name(name)

        def op(tx: _Tx) -> bytes:
            rec = tx.inode(ino)
            value = None
            if self._xattr_allowed(rec, name):
                value = tx.txn.get(u64(ino) + name, db=self.dbs[DB_XATTRS])
            if value is None:
                raise FsError(errno.ENODATA, f"no xattr {name[:64]!r} on inode {ino}")
            return bytes(value)

        return self._read(op)

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if flags & ~(XATTR_CREATE | XATTR_REPLACE):
            raise FsError(errno.EINVAL, f"invalid setxattr flags {flags}")
        _check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG, f"xattr value of {len(value)} bytes > {XATTR_SIZE_MAX}")

        def op(tx: _Tx) -> None:
            rec = tx.inode(ino)
            if not self._xattr_allowed(rec, name):
                raise FsError(errno.EPERM, "user xattrs only on regular files and directories")
            key = u64(ino) + name
            exists = tx.txn.get(key, db=self.dbs[DB_XATTRS]) is not None
            if exists and flags & XATTR_CREATE:
                raise FsError(errno.EEXIST, f"xattr {name[:64]!r} exists")
            if not exists:
                if flags & XATTR_REPLACE:
                    raise FsError(errno.ENODATA, f"no xattr {name[:64]!r} on inode {ino}")
                names = sum(len(k) - 8 + 1 for k, _ in tx.prefix_items(DB_XATTRS, u64(ino)))
                if names + len(name) + 1 > XATTR_LIST_MAX:
                    raise FsError(errno.ENOSPC, f"no room for more xattr names on inode {ino}")
            tx.txn.put(key, value, db=self.dbs[DB_XATTRS])
            rec["ctime"] = tx.now

        self._write(op)

    def listxattr(self, ino: int) -> list[bytes]:
        def op(tx: _Tx) -> list[bytes]:
            tx.inode(ino)
            return [key[8:] for key, _ in tx.prefix_items(DB_XATTRS, u64(ino))]

        return self._read(op)

    def removexattr(self, ino: int, name: bytes) -> None:
        _check_xattr_name(name)

        def op(tx: _Tx) -> None:
            rec = tx.inode(ino)
            if not self._xattr_allowed(rec, name):
                raise FsError(errno.EPERM, "user xattrs only on regular files and directories")
            key = u64(ino) + name
            if not tx.txn.delete(key, db=self.dbs[DB_XATTRS]):
                raise FsError(errno.ENODATA, f"no xattr {name[:64]!r} on inode {ino}")
            rec["ctime"] = tx.now

        self._write(op)

    # ---- storage jobs ----------------------------------------------------------

    def gc_jobs(self, after: int = 0, limit: int = 256) -> list[GcJob]:
        """Freed files whose chunks are still to be deleted, by inode."""

        def op(tx: _Tx) -> list[GcJob]:
            out: list[GcJob] = []
            for key, raw in tx.prefix_items(DB_GC, b""):
                ino = int(U64.unpack(key)[0])
                if ino <= after:
                    continue
                job = unpack(raw)
                out.append({"ino": ino, "layout": job["layout"], "queued": job["queued"]})
                if len(out) >= limit:
                    break
            return out

        return self._read(op)

    def gc_done(self, ino: int) -> None:
        self._write(lambda tx: tx.txn.delete(u64(ino), db=self.dbs[DB_GC]))

    @staticmethod
    def _truncate_job(ino: int, raw: bytes) -> TruncateJob:
        job = unpack(raw)
        return {
            "ino": ino,
            "size": job["size"],
            "layout": job["layout"],
            "seq": job["seq"],
            "queued": job["queued"],
        }

    def truncate_job(self, ino: int) -> TruncateJob | None:
        def op(tx: _Tx) -> TruncateJob | None:
            raw = tx.txn.get(u64(ino), db=self.dbs[DB_TRUNCATES])
            return None if raw is None else self._truncate_job(ino, bytes(raw))

        return self._read(op)

    def truncate_jobs(self, after: int = 0, limit: int = 256) -> list[TruncateJob]:
        def op(tx: _Tx) -> list[TruncateJob]:
            out: list[TruncateJob] = []
            for key, raw in tx.prefix_items(DB_TRUNCATES, b""):
                ino = int(U64.unpack(key)[0])
                if ino <= after:
                    continue
                out.append(self._truncate_job(ino, raw))
                if len(out) >= limit:
                    break
            return out

        return self._read(op)

    def truncate_done(self, ino: int, seq: int) -> bool:
        """Delete the job if it is still the one carried out (*seq*); a newer
        shrink recorded meanwhile must run too. Returns whether it was deleted."""

        def op(tx: _Tx) -> bool:
            raw = tx.txn.get(u64(ino), db=self.dbs[DB_TRUNCATES])
            if raw is None or unpack(raw)["seq"] != seq:
                return False
            tx.txn.delete(u64(ino), db=self.dbs[DB_TRUNCATES])
            return True

        return self._write(op)

    def counts(self) -> dict[str, int]:
        """Entries per sub-database (for startup logs and tests)."""
        with self.env.begin() as txn:
            return {
                name.decode(): int(txn.stat(db)["entries"])
                for name, db in self.dbs.items()
                if name != DB_INFO
            }

    # ---- consistency check ----------------------------------------------------

    def fsck(self) -> list[str]:
        """Check every invariant of the namespace; returns the problems found
        (empty when consistent). Reads one snapshot, so it may run while the
        server serves."""
        from shufflefs.metadata.fsck import Fsck  # it builds on this module

        with self.env.begin() as txn:
            return Fsck(self, txn).run()
