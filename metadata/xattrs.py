"""Extended attributes: raw values in `xattrs`, keyed by inode + name, with
Linux's namespaces and limits (docs/metadata.md)."""

from __future__ import annotations

import errno

from shufflefs.metadata.checks import check_xattr_name
from shufflefs.metadata.protocol import XATTR_CREATE, XATTR_REPLACE, XATTR_SIZE_MAX
from shufflefs.metadata.records import DB_XATTRS, Rec, is_dir, is_reg, u64, xattr_key
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError

XATTR_LIST_MAX = 65536  # as Linux: the names of one inode, NUL-terminated, fit in this


def xattr_allowed(rec: Rec, name: bytes) -> bool:
    """user.* lives on regular files and directories only (as Linux)."""
    return not name.startswith(b"user.") or is_reg(rec) or is_dir(rec)


def settable_xattr(tx: Tx, ino: int, name: bytes) -> Rec:
    rec = tx.inode(ino)
    if not xattr_allowed(rec, name):
        raise FsError(errno.EPERM, "user xattrs only on regular files and directories")
    return rec


def no_xattr(ino: int, name: bytes) -> FsError:
    return FsError(errno.ENODATA, f"no xattr {name[:64]!r} on inode {ino}")


class XattrOps:
    """The extended-attribute operations of `NamespaceStore`."""

    txns: Transactions

    def getxattr(self, ino: int, name: bytes) -> bytes:
        check_xattr_name(name)

        def body(tx: Tx) -> bytes:
            rec = tx.inode(ino)
            value = None
            if xattr_allowed(rec, name):
                value = tx.get_raw(DB_XATTRS, xattr_key(ino, name))
            if value is None:
                raise no_xattr(ino, name)
            return value

        return self.txns.read(body)

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if flags & ~(XATTR_CREATE | XATTR_REPLACE):
            raise FsError(errno.EINVAL, f"invalid setxattr flags {flags}")
        check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG, f"xattr value of {len(value)} bytes > {XATTR_SIZE_MAX}")

        def body(tx: Tx) -> None:
            rec = settable_xattr(tx, ino, name)
            key = xattr_key(ino, name)
            exists = tx.get_raw(DB_XATTRS, key) is not None
            if exists and flags & XATTR_CREATE:
                raise FsError(errno.EEXIST, f"xattr {name[:64]!r} exists")
            if not exists:
                if flags & XATTR_REPLACE:
                    raise no_xattr(ino, name)
                names = sum(len(k) - 8 + 1 for k, _ in tx.prefix_items(DB_XATTRS, u64(ino)))
                if names + len(name) + 1 > XATTR_LIST_MAX:
                    raise FsError(errno.ENOSPC, f"no room for more xattr names on inode {ino}")
            tx.put(DB_XATTRS, key, value)
            rec["ctime"] = tx.now

        self.txns.write(body)

    def listxattr(self, ino: int) -> list[bytes]:
        def body(tx: Tx) -> list[bytes]:
            tx.inode(ino)
            return [key[8:] for key, _ in tx.prefix_items(DB_XATTRS, u64(ino))]

        return self.txns.read(body)

    def removexattr(self, ino: int, name: bytes) -> None:
        check_xattr_name(name)

        def body(tx: Tx) -> None:
            rec = settable_xattr(tx, ino, name)
            if not tx.delete(DB_XATTRS, xattr_key(ino, name)):
                raise no_xattr(ino, name)
            rec["ctime"] = tx.now

        self.txns.write(body)
