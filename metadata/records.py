"""How the namespace is laid out in LMDB: sub-databases, keys and records.

Integers in keys are 8-byte big-endian, so key order is numeric order and
everything that belongs to one inode, directory or session is one contiguous
key range (a directory is the range of its inode in `dentries`). Records are
msgpack maps. The table of every sub-database is in docs/metadata.md; this
module is the only place that knows the byte formats.
"""

from __future__ import annotations

import stat
import struct
from typing import Any, TypedDict

import msgpack

from shufflefs.metadata.protocol import ROOT_INODE, Attr, Layout

Rec = dict[str, Any]  # an inode record as stored (see `new_inode`)

FORMAT_VERSION = 1
U64 = struct.Struct(">Q")
DENTRY_VALUE = struct.Struct(">QB")  # child inode, file type (S_IFMT >> 12)
MAX_CHUNKS = 1 << 32  # chunk indexes are 32-bit (storage chunk ids)
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
DB_REQUESTS = b"requests"  # request id -> the result of its mutation (request_ids.py)
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
    DB_REQUESTS,
)

# keys of `info`
INFO_FORMAT = b"format"
INFO_CREATED = b"created"

# counter keys: the next id to hand out (ids are never reused)
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


# ---- encoding ------------------------------------------------------------------


def u64(n: int) -> bytes:
    return U64.pack(n)


def read_u64(data: bytes) -> int:
    return int(U64.unpack(data)[0])


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True)


# ---- keys ------------------------------------------------------------------------


def dentry_key(parent: int, name: bytes) -> bytes:
    return u64(parent) + name


def xattr_key(ino: int, name: bytes) -> bytes:
    return u64(ino) + name


def handle_key(ino: int, handle: int) -> bytes:
    """Key of `handles`; `session_handles` uses the same shape, session first."""
    return u64(ino) + u64(handle)


def dentry_value(ino: int, mode: int) -> bytes:
    return DENTRY_VALUE.pack(ino, file_type(mode))


def dentry_child(value: bytes) -> int:
    return int(DENTRY_VALUE.unpack(value)[0])


# ---- inode records -----------------------------------------------------------------


def file_type(mode: int) -> int:
    return stat.S_IFMT(mode) >> 12


def is_dir(rec: Rec) -> bool:
    return stat.S_ISDIR(rec["mode"])


def is_reg(rec: Rec) -> bool:
    return stat.S_ISREG(rec["mode"])


def is_lnk(rec: Rec) -> bool:
    return stat.S_ISLNK(rec["mode"])


def new_inode(mode: int, uid: int, gid: int, parent: int, now: int) -> Rec:
    """A fresh inode record. `parent` is kept for directories only (0 otherwise),
    so '..' and the rename loop check need no reverse lookup."""
    return {
        "mode": mode,
        "nlink": 2 if stat.S_ISDIR(mode) else 1,
        "uid": uid,
        "gid": gid,
        "rdev": 0,
        "size": 0,
        "atime": now,
        "mtime": now,
        "ctime": now,
        "parent": parent if stat.S_ISDIR(mode) else 0,
    }


def root_inode(now: int) -> Rec:
    return new_inode(stat.S_IFDIR | 0o755, 0, 0, ROOT_INODE, now)


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
        "change": rec.get("change", 0),
    }


def entry_row(name: bytes, ino: int, rec: Rec) -> list[Any]:
    """`attr_of` as a listing row (metadata/listing_rows.py, ATTR_ROW)."""
    mode = rec["mode"]
    return [
        name,
        ino,
        mode,
        rec["nlink"],
        rec["uid"],
        rec["gid"],
        rec["rdev"],
        rec["size"],
        rec["atime"],
        rec["mtime"],
        rec["ctime"],
        rec["parent"] if stat.S_ISDIR(mode) else 0,
        rec.get("change", 0),
    ]


def layout_of(rec: Rec) -> Layout | None:
    layout = rec.get("layout")
    if layout is None:
        return None
    return {"chunk_size": layout["chunk_size"], "chains": list(layout["chains"])}


def max_file_size(layout: Layout) -> int:
    return layout["chunk_size"] * MAX_CHUNKS


# ---- job records -------------------------------------------------------------------


def gc_record(layout: Layout, now: int) -> bytes:
    return pack({"layout": layout, "queued": now})


def gc_job(ino: int, raw: bytes) -> GcJob:
    job = unpack(raw)
    return {"ino": ino, "layout": job["layout"], "queued": job["queued"]}


def truncate_record(size: int, layout: Layout, seq: int, now: int) -> bytes:
    return pack({"size": size, "layout": layout, "seq": seq, "queued": now})


def truncate_job(ino: int, raw: bytes) -> TruncateJob:
    job = unpack(raw)
    return {
        "ino": ino,
        "size": job["size"],
        "layout": job["layout"],
        "seq": job["seq"],
        "queued": job["queued"],
    }
