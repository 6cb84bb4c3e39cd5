"""The POSIX operations on names and directories: lookup, resolve, readdir,
readlink, and creating, linking, removing and renaming entries.

Each operation is two steps: check its arguments (`checks`, before any
transaction), then one body run by `Transactions.write` (or `.read`) that
loads, checks and changes records through its `Tx`. The semantics follow
Linux on a local filesystem, errno for errno (docs/metadata.md, "Semantics
worth knowing"). Opening files, their sizes and handles are in `files`;
extended attributes in `xattrs`.
"""

from __future__ import annotations

import errno
import logging
import stat
from collections.abc import Callable
from typing import Any, TypeVar

from shufflefs.metadata.checks import (
    DOTS,
    check_mode,
    check_name,
    check_new_name,
    check_owner,
    check_path,
    check_rdev,
    check_symlink_target,
)
from shufflefs.metadata.lifetime import drop_name
from shufflefs.metadata.listing_rows import ReaddirRowsPage
from shufflefs.metadata.protocol import (
    NAME_MAX,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INODE,
    Attr,
    Layout,
    ReaddirLayoutsPage,
    ReaddirPage,
    Unlinked,
)
from shufflefs.metadata.records import (
    C_INO,
    Rec,
    attr_of,
    entry_row,
    is_dir,
    is_lnk,
    layout_of,
    new_inode,
)
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metadata.namespace")

E = TypeVar("E")

# Called inside the write transaction, only when a regular file is really
# created, so it must not block (the server's reads its routing snapshot).
LayoutSource = Callable[[], Layout]

MAXSYMLINKS = 40  # as Linux
READDIR_MAX = 1024  # entries per page: keeps a reply far below the frame body limit


def make_inode(
    tx: Tx, parent: int, name: bytes, mode: int, uid: int, gid: int, **extra: Any
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
    rec = new_inode(mode, uid, gid, parent, tx.now)
    rec.update(extra)
    tx.add_inode(ino, rec)
    tx.put_entry(parent, name, ino, mode)
    if stat.S_ISDIR(mode):
        prec["nlink"] += 1
    tx.touch_dir(prec)
    return ino, rec


def existing_entry(tx: Tx, parent: int, name: bytes) -> int:
    ino = tx.entry(parent, name)
    if ino is None:
        raise FsError(errno.ENOENT, f"no entry {name[:64]!r} in directory {parent}")
    return ino


def path_components(path: bytes) -> list[bytes]:
    """Components of *path*, reversed (a stack). A trailing slash becomes a
    final '.', which demands a directory just as Linux does."""
    parts = [p for p in path.split(b"/") if p]
    if path.endswith(b"/") and parts:
        parts.append(b".")
    parts.reverse()
    return parts


class NameOps:
    """The name and directory operations of `NamespaceStore`."""

    txns: Transactions

    # ---- looking up --------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Attr:
        check_name(name)

        def body(tx: Tx) -> Attr:
            rec = tx.directory(parent)
            if name == b".":
                return attr_of(parent, rec)
            if name == b"..":
                return attr_of(rec["parent"], tx.inode(rec["parent"]))
            ino = existing_entry(tx, parent, name)
            return attr_of(ino, tx.inode(ino))

        return self.txns.read(body)

    def getattr(self, ino: int) -> Attr:
        return self.txns.read(lambda tx: attr_of(ino, tx.inode(ino)))

    def getattrs(self, inos: list[int]) -> list[Attr | None]:
        """Attributes of each of *inos* from one read snapshot (None: no such
        inode); at most READDIR_MAX, E2BIG beyond."""
        if len(inos) > READDIR_MAX:
            raise FsError(errno.E2BIG, f"getattrs: {len(inos)} inodes, at most {READDIR_MAX}")

        def one(tx: Tx, ino: int) -> Attr | None:
            try:
                return attr_of(ino, tx.inode(ino))
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    raise
                return None

        return self.txns.read(lambda tx: [one(tx, ino) for ino in inos])

    def resolve(self, path: bytes, follow: bool = True) -> Attr:
        """Walk an absolute path from the root, following symlinks in the
        middle and (with *follow*) at the end."""
        check_path(path)

        def body(tx: Tx) -> Attr:
            stack = path_components(path)
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
                child = existing_entry(tx, cur, comp)
                crec = tx.inode(child)
                if is_lnk(crec) and (stack or follow):
                    links += 1
                    if links > MAXSYMLINKS:
                        raise FsError(errno.ELOOP, f"more than {MAXSYMLINKS} symbolic links")
                    target: bytes = crec["target"]
                    if target.startswith(b"/"):
                        cur = ROOT_INODE
                    stack.extend(path_components(target))
                    continue
                cur = child
            return attr_of(cur, tx.inode(cur))

        return self.txns.read(body)

    def readlink(self, ino: int) -> bytes:
        def body(tx: Tx) -> bytes:
            rec = tx.inode(ino)
            if not is_lnk(rec):
                raise FsError(errno.EINVAL, f"inode {ino} is not a symbolic link")
            target: bytes = rec["target"]
            return target

        return self.txns.read(body)

    def readdir(self, ino: int, after: bytes | None = None, limit: int = 256) -> ReaddirPage:
        """A page in name order after the name *after*: a cursor that is a
        name, not a position, cannot skip or repeat an entry when others come
        and go between pages."""
        entries, more = self._page(ino, after, limit, lambda n, c, r: (n, attr_of(c, r)))
        return {"entries": entries, "more": more}

    def readdir_rows(
        self, ino: int, after: bytes | None = None, limit: int = 256
    ) -> ReaddirRowsPage:
        """`readdir` with each entry as a row (metadata/listing_rows.py, ATTR_ROW)."""
        entries, more = self._page(ino, after, limit, entry_row)
        return {"entries": entries, "more": more}

    def readdir_layouts(
        self, ino: int, after: bytes | None = None, limit: int = 256
    ) -> ReaddirLayoutsPage:
        """`readdir` with each regular file's layout: what a reader of every
        file of a directory needs, in one read transaction per page."""
        entries, more = self._page(
            ino, after, limit, lambda n, c, r: (n, attr_of(c, r), layout_of(r))
        )
        return {"entries": entries, "more": more}

    def _page(
        self, ino: int, after: bytes | None, limit: int, entry: Callable[[bytes, int, Rec], E]
    ) -> tuple[list[E], bool]:
        """A page of directory *ino*, each child as *entry* (name, inode,
        record) makes it."""
        if limit < 1:
            raise FsError(errno.EINVAL, f"readdir limit {limit} < 1")
        limit = min(limit, READDIR_MAX)
        if after is not None and len(after) > NAME_MAX:
            raise FsError(errno.EINVAL, "readdir cursor longer than a name")

        def body(tx: Tx) -> tuple[list[E], bool]:
            tx.directory(ino)
            children, more = tx.children(ino, after, limit)
            return [entry(n, c, r) for n, c, r in children], more

        return self.txns.read(body)

    # ---- creating ------------------------------------------------------------

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
        check_new_name(name)
        check_mode(mode)
        check_owner(uid, gid)
        check_rdev(rdev)
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind == stat.S_IFDIR:
            raise FsError(errno.EPERM, "mknod cannot create a directory (use mkdir)")
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise FsError(errno.EINVAL, f"mknod cannot create file type {kind:o}")

        def body(tx: Tx) -> Attr:
            extra: dict[str, Any] = {}
            if kind in (stat.S_IFCHR, stat.S_IFBLK):
                extra["rdev"] = rdev
            if kind == stat.S_IFREG:
                tx.live_directory(parent)  # no layout for a create that cannot happen
                if tx.entry(parent, name) is None:
                    extra["layout"] = layout()
            ino, rec = make_inode(tx, parent, name, kind | (mode & 0o7777), uid, gid, **extra)
            return attr_of(ino, rec)

        return self.txns.write(body)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        check_new_name(name)
        check_mode(mode)
        check_owner(uid, gid)

        def body(tx: Tx) -> Attr:
            ino, rec = make_inode(tx, parent, name, stat.S_IFDIR | (mode & 0o1777), uid, gid)
            return attr_of(ino, rec)

        return self.txns.write(body)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        check_new_name(name)
        check_owner(uid, gid)
        check_symlink_target(target)

        def body(tx: Tx) -> Attr:
            ino, rec = make_inode(
                tx, parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target, size=len(target)
            )
            return attr_of(ino, rec)

        return self.txns.write(body)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        check_new_name(new_name)

        def body(tx: Tx) -> Attr:
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

        return self.txns.write(body)

    # ---- removing and renaming ----------------------------------------------

    def unlink(self, parent: int, name: bytes) -> Unlinked:
        """Whether the inode was freed (it may have a GC job now), and the
        directory's attributes after it."""
        check_name(name)
        if name in DOTS:
            raise FsError(errno.EISDIR, f"{name!r} is a directory")

        def body(tx: Tx) -> Unlinked:
            prec = tx.directory(parent)
            ino = existing_entry(tx, parent, name)
            rec = tx.inode(ino)
            if is_dir(rec):
                raise FsError(errno.EISDIR, f"{name[:64]!r} is a directory")
            tx.remove_entry(parent, name)
            tx.touch_dir(prec)
            freed = drop_name(tx, prec, ino, rec)
            return {"freed": freed, "parent_attr": attr_of(parent, prec)}

        return self.txns.write(body)

    def rmdir(self, parent: int, name: bytes) -> bool:
        check_name(name)
        if name == b".":
            raise FsError(errno.EINVAL, "cannot remove '.'")
        if name == b"..":
            raise FsError(errno.ENOTEMPTY, "cannot remove '..'")

        def body(tx: Tx) -> bool:
            prec = tx.directory(parent)
            ino = existing_entry(tx, parent, name)
            rec = tx.inode(ino)
            if not is_dir(rec):
                raise FsError(errno.ENOTDIR, f"{name[:64]!r} is not a directory")
            if not tx.is_empty(ino):
                raise FsError(errno.ENOTEMPTY, f"directory {name[:64]!r} is not empty")
            tx.remove_entry(parent, name)
            tx.touch_dir(prec)
            return drop_name(tx, prec, ino, rec)

        return self.txns.write(body)

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

        def body(tx: Tx) -> bool:
            prec = tx.directory(parent)
            nprec = tx.directory(new_parent)
            src = existing_entry(tx, parent, name)
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
                _exchange(
                    tx, (parent, prec, name, src, srec), (new_parent, nprec, new_name, dst, drec)
                )
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
                freed = drop_name(tx, nprec, dst, drec)
            tx.put_entry(new_parent, new_name, src, srec["mode"])
            if is_dir(srec) and parent != new_parent:
                prec["nlink"] -= 1
                nprec["nlink"] += 1
                srec["parent"] = new_parent
            srec["ctime"] = tx.now
            tx.touch_dir(prec)
            tx.touch_dir(nprec)
            return freed

        return self.txns.write(body)


# (directory, its record, name in it, inode named, its record)
_Named = tuple[int, Rec, bytes, int, Rec]


def _exchange(tx: Tx, a: _Named, b: _Named) -> None:
    """RENAME_EXCHANGE: the two names swap inodes; a directory that changes
    parent moves its '..' link count with it."""
    parent, prec, name, src, srec = a
    new_parent, nprec, new_name, dst, drec = b
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
