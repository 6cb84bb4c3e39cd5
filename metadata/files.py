"""The POSIX operations on open files and attributes: create, open, release,
setattr and the length a writer reports.

Opening takes a handle for the caller's session, held in the server's memory
(`readonly.ReadOnlyHandles`: no commit for it, nor for its release); the
handle keeps an unlinked file alive until `release`. A shrink (setattr with a
smaller size, or O_TRUNC) commits the new size together with a truncate job
(`jobs.record_truncate`) that the server carries out on storage before it
replies.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TypedDict

from shufflefs.metadata.checks import (
    DOTS,
    check_ino,
    check_mode,
    check_name,
    check_owner,
    check_setattr,
    check_size,
    check_time,
)
from shufflefs.metadata.jobs import record_truncate
from shufflefs.metadata.lifetime import free_if_orphan, remove_handle
from shufflefs.metadata.namespace import LayoutSource, make_inode
from shufflefs.metadata.protocol import (
    SESSION_EXPIRED,
    Attr,
    ClosedFile,
    CreatedFile,
    NewFile,
    OpenResult,
    WrittenClose,
    is_read_only_handle,
)
from shufflefs.metadata.records import (
    Rec,
    attr_of,
    is_dir,
    is_lnk,
    is_reg,
    layout_of,
    max_file_size,
)
from shufflefs.metadata.sessions import live_session
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError


def set_size(tx: Tx, ino: int, rec: Rec, size: int) -> None:
    if size < rec["size"]:
        record_truncate(tx, ino, rec["layout"], size)
    rec["size"] = size


def regular_file(ino: int, rec: Rec, size: int, what: str) -> None:
    """Only a regular file has a size to set, within its layout's limit."""
    if is_dir(rec):
        raise FsError(errno.EISDIR, f"inode {ino} is a directory")
    if not is_reg(rec):
        raise FsError(errno.EINVAL, f"inode {ino} is not a regular file")
    if size > max_file_size(rec["layout"]):
        raise FsError(errno.EFBIG, f"{what} {size} beyond the file's chunk index limit")


def opens_for_writing(flags: int) -> bool:
    """Does an open with *flags* change anything (write access or O_TRUNC)?
    Only such opens take a write transaction (the session check, a pending
    cut settled, O_TRUNC); the rest one read snapshot."""
    return (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)


def openable(tx: Tx, ino: int, flags: int) -> Rec:
    rec = tx.inode(ino)
    if is_dir(rec) and opens_for_writing(flags):
        raise FsError(errno.EISDIR, f"inode {ino} is a directory")
    if is_lnk(rec):
        raise FsError(errno.ELOOP, f"inode {ino} is a symbolic link")
    return rec


def open_inode(tx: Tx, ino: int, flags: int, session: int) -> OpenResult:
    rec = openable(tx, ino, flags)
    if flags & os.O_TRUNC and is_reg(rec):
        set_size(tx, ino, rec, 0)
        rec["mtime"] = rec["ctime"] = tx.now
    handle = tx.read_only.hold(tx, session, ino)
    return {"attr": attr_of(ino, rec), "layout": layout_of(rec), "handle": handle}


class CloseOutcome(TypedDict):
    closed: list[ClosedFile]  # one per file, in order
    freed: bool  # a close freed an unlinked file (its storage jobs are due)


class FileOps:
    """The open-file and attribute operations of `NamespaceStore`."""

    txns: Transactions
    clock: Callable[[], float]

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
        check_mode(mode)
        check_owner(uid, gid)
        if name in DOTS:
            raise FsError(
                errno.EEXIST if flags & os.O_EXCL else errno.EISDIR, f"{name!r} is a directory"
            )

        def body(tx: Tx) -> OpenResult:
            live_session(tx, session, self.clock())
            tx.by = session  # its cache watch learns of the new name from the reply
            parent_rec = tx.live_directory(parent)
            existing = tx.entry(parent, name)
            if existing is not None:
                if flags & os.O_EXCL:
                    raise FsError(errno.EEXIST, f"{name[:64]!r} exists in directory {parent}")
                return open_inode(tx, existing, flags, session)
            ino, rec = make_inode(
                tx, parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid, layout=layout()
            )
            handle = tx.read_only.hold(tx, session, ino)
            return {
                "attr": attr_of(ino, rec),
                "layout": layout_of(rec),
                "handle": handle,
                "created": True,
                "parent_attr": attr_of(parent, parent_rec),
            }

        return self.txns.write(body)

    def create_files(
        self, files: list[NewFile], session: int, layout: LayoutSource
    ) -> list[CreatedFile]:
        """`create_files`: `create` of each file, each in its own nested
        transaction, so one that fails (EEXIST with O_EXCL, a name too long)
        is answered its `[errno, message]` while the others stand. A session
        that expired fails the whole call (before anything is made), as it
        fails `create`: the client opens a new one and sends it again."""
        created: list[CreatedFile] = []
        for f in files:
            try:
                opened = self.create(
                    f["parent"],
                    f["name"],
                    f["mode"],
                    f["flags"],
                    f["uid"],
                    f["gid"],
                    session,
                    layout,
                )
            except FsError as exc:
                if exc.code == SESSION_EXPIRED and not created:
                    raise
                created.append({"opened": None, "error": exc.to_wire()})
            else:
                created.append({"opened": opened, "error": None})
        return created

    def open(self, ino: int, flags: int, session: int) -> OpenResult:
        """A read-only open takes an in-memory handle and no write
        transaction (`open_read_only`); any other takes a durable one."""
        if not opens_for_writing(flags):
            return self.open_read_only(ino, flags, session)

        def body(tx: Tx) -> OpenResult:
            live_session(tx, session, self.clock())
            return open_inode(tx, ino, flags, session)

        return self.txns.write(body)

    def open_read_only(self, ino: int, flags: int, session: int) -> OpenResult:
        """One read snapshot and a handle in `readonly.ReadOnlyHandles`.
        Raises `readonly.FreeInProgress` if a free of *ino* is being committed
        (only possible with the writer in another thread: retry after it)."""
        check_ino(ino)
        found: list[OpenResult] = []

        def body(tx: Tx) -> None:
            live_session(tx, session, self.clock())
            rec = openable(tx, ino, flags)
            found.append({"attr": attr_of(ino, rec), "layout": layout_of(rec), "handle": 0})

        handle = self.txns.read_only.open(session, ino, lambda: self.txns.read(body))
        return {**found[0], "handle": handle}

    def release(self, ino: int, handle: int, session: int) -> bool:
        """Close a handle; releasing one already gone (its session expired) is
        not an error. Returns whether the inode was freed."""
        check_ino(ino)
        check_ino(handle, "handle")
        if is_read_only_handle(handle):
            orphan = self.release_read_only(handle, session)
            return orphan is not None and self.free_orphan(orphan)

        def body(tx: Tx) -> bool:
            return remove_handle(tx, ino, handle, session) and free_if_orphan(tx, ino)

        return self.txns.write(body)

    def close_files(self, files: list[WrittenClose], session: int) -> CloseOutcome:
        """`close_files`: per file its length report (`update_length`, if
        asked), the attributes set behind (a writeback mount's chmod, chown
        or utime of the file while open: `setattr`, if any), then its
        `release` (also if the report failed, as a client's
        close gives its handle back whatever happened; none for handle 0:
        a flush's report, with the closes it goes with), each in its own
        nested transaction: a file that fails is answered its error, the
        others stand."""
        closed: list[ClosedFile] = []
        freed = False
        for f in files:
            attr: Attr | None = None
            error: FsError | None = None
            try:
                if f["length"] is not None:
                    attr = self.update_length(f["ino"], f["length"], f["mtime"])
                if f.get("attrs"):
                    attr = self.setattr(f["ino"], **f["attrs"])
            except FsError as exc:
                error = exc  # the handle is given back all the same
            try:
                if f["handle"]:  # (0: a flush's report, its handle stays open)
                    freed = self.release(f["ino"], f["handle"], session) or freed
            except FsError as exc:
                error = error or exc
            closed.append({"attr": attr, "error": None if error is None else error.to_wire()})
        return {"closed": closed, "freed": freed}

    def release_read_only(self, handle: int, session: int) -> int | None:
        """Give an in-memory handle back, with no write transaction. Returns
        the inode if it was the last handle of an unnamed inode: the caller
        frees it with `free_orphan` (one write transaction)."""
        check_ino(handle, "handle")
        return self.txns.read_only.release(session, handle)

    def free_orphan(self, ino: int) -> bool:
        """Free *ino* if nothing names or holds it any more."""
        return self.txns.write(lambda tx: free_if_orphan(tx, ino))

    def free_orphans(self, inos: list[int]) -> int:
        """`free_orphan` of each of *inos* in one transaction: how many were freed."""
        return self.txns.write(lambda tx: sum(bool(free_if_orphan(tx, ino)) for ino in inos))

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
        check_setattr(mode, uid, gid, size, atime, mtime)

        def body(tx: Tx) -> Attr:
            rec = tx.inode(ino)
            if size is not None:
                regular_file(ino, rec, size, "size")
                set_size(tx, ino, rec, size)
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

        return self.txns.write(body)

    def update_length(self, ino: int, length: int, mtime: int | None = None) -> Attr:
        """A writer's report of how far it wrote: the size only grows here
        (shrinking is setattr's, with its truncate job)."""
        check_size(length, "length")
        if mtime is not None:
            check_time(mtime, "mtime")

        def body(tx: Tx) -> Attr:
            rec = tx.inode(ino)
            regular_file(ino, rec, length, "length")
            rec["size"] = max(rec["size"], length)
            if mtime is not None:
                rec["mtime"] = rec["ctime"] = mtime
            return attr_of(ino, rec)

        return self.txns.write(body)
