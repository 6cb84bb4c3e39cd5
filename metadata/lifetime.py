"""When an inode dies: names, open handles, and what a freed file leaves behind.

An inode lives while it has a name or an open handle (POSIX: an unlinked file
stays readable through the descriptors open on it). The inode is freed in
the same transaction as whatever took its last name or its last handle, and
a freed regular file leaves a GC job for its chunks (`jobs.record_gc`).
"""

from __future__ import annotations

import errno

from shufflefs.metadata.jobs import drop_truncate, record_gc
from shufflefs.metadata.records import (
    DB_HANDLES,
    DB_SESSION_HANDLES,
    DB_XATTRS,
    Rec,
    handle_key,
    is_dir,
    read_u64,
    u64,
)
from shufflefs.metadata.txn import Tx
from shufflefs.rpc.errors import FsError


def has_handles(tx: Tx, ino: int) -> bool:
    return tx.has_prefix(DB_HANDLES, u64(ino))


def remove_handle(tx: Tx, ino: int, handle: int, session: int) -> bool:
    """Give a durable handle back (one a store written before handles were
    held in memory may still hold); one already gone is not an error (False)."""
    key = handle_key(ino, handle)
    owner = tx.get_raw(DB_HANDLES, key)
    if owner is None:
        return False
    if read_u64(owner) != session:
        raise FsError(errno.EBADF, f"handle {handle} belongs to another session")
    tx.delete(DB_HANDLES, key)
    tx.delete(DB_SESSION_HANDLES, handle_key(session, handle))
    return True


def drop_name(tx: Tx, parent_rec: Rec, ino: int, rec: Rec) -> bool:
    """One name of *ino* is gone (unlink, rmdir, replaced by rename).
    Returns whether the inode was freed."""
    if is_dir(rec):
        rec["nlink"] = 0
        parent_rec["nlink"] -= 1
    else:
        rec["nlink"] -= 1
    rec["ctime"] = tx.now
    return rec["nlink"] == 0 and free_if_unused(tx, ino, rec)


def free_if_unused(tx: Tx, ino: int, rec: Rec) -> bool:
    """Free an inode that has no name left, unless a handle (durable, or
    read-only in memory: `readonly.ReadOnlyHandles`) holds it."""
    if rec["nlink"] > 0 or has_handles(tx, ino) or not tx.read_only.claim_free(tx, ino):
        return False
    tx.drop_inode(ino)
    for key, _ in list(tx.prefix_items(DB_XATTRS, u64(ino))):
        tx.delete(DB_XATTRS, key)
    drop_truncate(tx, ino)
    layout = rec.get("layout")
    if layout is not None:
        record_gc(tx, ino, layout)
    return True


def free_if_orphan(tx: Tx, ino: int) -> bool:
    """After a handle went away: free *ino* if that was all that held it."""
    rec = tx.get(ino)
    return rec is not None and rec["nlink"] == 0 and free_if_unused(tx, ino, rec)
