"""The metadata server's wire protocol: message shapes and a typed stub.

Inodes are 64-bit ids (root = 1). Times are integer nanoseconds since the
epoch. Names are bytes (any byte but ``/`` and NUL, 1..255 bytes long).
Errors are POSIX errnos, exactly those Linux gives for the same operation on a
local filesystem (ENOENT, ENOTDIR, EEXIST, ENOTEMPTY, ENAMETOOLONG, EISDIR,
EINVAL, EPERM, ENODATA, ERANGE, E2BIG, ...).

Permission checks are not made here: the kernel makes them on the mount
(``default_permissions``), and a native client holding the cluster secret is
trusted like root. uid/gid of new inodes come from the caller.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict

from shufflefs.metadata.listing_rows import (
    ROWS_REFUSED,
    ReaddirRowsPage,
    WatchedDirRowsPage,
    entry_of_row,
    rows_refused,
)
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

ROOT_INODE = 1
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
SYMLINK_MAX = 4095

READDIR_MAX = 1024  # a readdir page holds at most this many entries, whatever the limit asked
# open/create naming a session the server does not hold (expired, closed, or
# lost) fail with this errno: open a new session and call again. Distinct from
# ENOENT so it cannot be mistaken for a missing file, and not a transient code
# so a retry loop does not repeat the call with the same dead session.
SESSION_EXPIRED = errno.EKEYEXPIRED

# setxattr flags (as in <sys/xattr.h>)
XATTR_CREATE = 1
XATTR_REPLACE = 2
# rename flags (as in <linux/fs.h>)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


RO_HANDLE_BIT = 1 << 62  # set in every read-only handle id (held in the server's memory only)


def is_read_only_handle(handle: int) -> bool:
    return handle > 0 and bool(handle & RO_HANDLE_BIT)


class Layout(TypedDict):
    chunk_size: int  # power of two
    chains: list[int]  # chunk k of the file lives on chains[k % len(chains)]


class Attr(TypedDict):
    ino: int
    mode: int  # file type and permission bits, as st_mode
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime: int  # ns
    mtime: int  # ns
    ctime: int  # ns
    parent: int  # for directories, the parent's inode ('..'); 0 otherwise
    # raised by every committed change of the inode (its data's length
    # report included): equal counters mean an unchanged file
    change: int


class OpenResult(TypedDict):
    attr: Attr
    layout: Layout | None  # None for anything but a regular file
    handle: int  # pass to release(); keeps an unlinked file alive until then
    created: NotRequired[bool]  # create made the file (it has no xattrs yet)
    # create made the file: the parent directory's attributes after it (the
    # kernel drops its cached ones on a create and would ask for them next)
    parent_attr: NotRequired[Attr]


class Unlinked(TypedDict):
    """What an unlink did (the store's answer; the RPC answers *parent_attr*)."""

    freed: bool  # the last name of an inode nobody holds: freed (a GC job now)
    parent_attr: Attr  # the directory after it (the kernel asks for it next)


class ReaddirPage(TypedDict):
    entries: list[tuple[bytes, Attr]]  # in name order, '.' and '..' not included
    more: bool  # another page follows: call again with after = the last name


class ReaddirLayoutsPage(TypedDict):
    entries: list[tuple[bytes, Attr, Layout | None]]  # as ReaddirPage, with regular files' layouts
    more: bool


class FilesPage(TypedDict):
    files: list[tuple[int, int, Layout]]  # (inode, size, layout) of regular files, by inode
    more: bool  # another page follows: call again with after = the last inode


class PendingJob(TypedDict):
    """A GC or truncate job the metadata server still owes storage
    (metadata/jobs.py): its chunks past *size* on *layout* are about to go
    (a GC job's size is 0: every chunk)."""

    ino: int
    size: int
    layout: Layout


class Session(TypedDict):
    session: int
    lease: float  # seconds: renew well before; an expired session's handles are closed


class MountInfo(TypedDict):
    """What a FUSE mount tells the metadata server of itself at session open,
    so `shufflefs status` can list every mount (fuse/mount_options.py)."""

    mountpoint: str
    mode: Literal["rw", "writeback", "ro", "immutable"]  # writeback: rw, closes behind
    attr_timeout: float  # seconds, as handed to the kernel
    entry_timeout: float
    negative_timeout: float
    handle_linger: float  # seconds an idle read-only handle is kept for the next open


class SessionInfo(TypedDict):
    session: int
    client: str
    host: str
    pid: int
    created: float  # wall-clock seconds
    expires: float
    mount: MountInfo | None  # None: not a mount (the native client, a tool)
    open_ro: int  # read-only handles it holds now (in the server's memory)


class OwedAttrs(TypedDict, total=False):
    """Attributes a writeback mount set on a file it has open for writing
    and sends with the file's close (`setattr`'s fields but the size)."""

    mode: int
    uid: int
    gid: int
    atime: int
    mtime: int


class WrittenClose(TypedDict):
    """One close of a handle open for writing, in `close_files`."""

    ino: int
    handle: int  # given back last (0: none, a flush's report of a handle still open)
    length: int | None  # reported first, as `update_length` does (None: no report)
    mtime: int | None  # with the length: the time of the writes (ns), or None to keep it
    attrs: NotRequired[OwedAttrs]  # then set, as `setattr` does (absent: none)


class ClosedFile(TypedDict):
    """How one close of `close_files` went (each on its own)."""

    attr: Attr | None  # after the length report and the attrs (None: neither asked, or failed)
    error: list[Any] | None  # [errno, message] if this close failed


class NewFile(TypedDict):
    """One file of `create_files`: `create`'s arguments but the session."""

    parent: int
    name: bytes
    mode: int
    flags: int
    uid: int
    gid: int


class CreatedFile(TypedDict):
    """How one create of `create_files` went (each on its own)."""

    opened: OpenResult | None  # what `create` answers (None: it failed)
    error: list[Any] | None  # [errno, message] if this create failed


class FsStats(TypedDict):
    files: int  # inodes in use
    max_files: int


# the methods that change the namespace: they take a `request` id, the same
# through every retry, so that a retried one is answered, not applied again
MUTATIONS = frozenset(
    {
        "session_open",
        "session_renew",
        "session_close",
        "setattr",
        "update_length",
        "mknod",
        "mkdir",
        "create",
        "create_files",
        "open",
        "release",
        "release_read_only",
        "close_files",
        "unlink",
        "rmdir",
        "rename",
        "link",
        "symlink",
        "setxattr",
        "removexattr",
    }
)


class WatchedDirPage(TypedDict):
    entries: list[tuple[bytes, Attr]]  # the first page, as ReaddirPage's
    more: bool
    attr: Attr  # the directory's own, read before the page: its change counter
    # the change counter the session's watch of it runs from: the client may
    # trust the page only when it is attr's (None: not watched, too many)
    since: int | None


class CacheWatchReply(TypedDict):
    token: int  # the watcher's: a new one means trust nothing cached before
    seq: int  # acknowledge with this once `changed` is applied
    changed: list[list[int]]  # [ino, change counter now] of files this client caches
    lease: float  # seconds from the request's sending that the cache may be trusted


class MetaStub:
    """Typed calls to a metadata server at one address. With *request*
    (`[client nonce, counter]`), mutations carry it as their request id.
    With *after*, the server runs the call only once it has applied the
    namespace log that far (a follower's read: metadata/follower_reads.py);
    *seen* is told the log position every reply carries."""

    def __init__(
        self,
        rpc: RpcClient,
        address: str,
        timeout: float = 10.0,
        request: list[int] | None = None,
        *,
        after: int | None = None,
        seen: Callable[[int], None] | None = None,
    ) -> None:
        self.rpc = rpc
        self.address = address
        self.timeout = timeout
        self.request = request
        self.after = after
        self.seen = seen

    async def _call(self, method: str, **args: Any) -> Any:
        if self.request is not None and method in MUTATIONS:
            args["request"] = self.request
        response = await self.rpc.request(
            self.address, method, args, timeout=self.timeout, after=self.after
        )
        if self.seen is not None and response.position is not None:
            self.seen(response.position)
        return response.result

    async def _rows(self, method: str, args: dict[str, Any]) -> Any:
        """*method*'s listing with rows=True (metadata/listing_rows.py), or
        None from a server that refuses them (remembered: it is asked for
        maps from then on)."""
        if self.address in ROWS_REFUSED:
            return None
        try:
            return await self._call(method, rows=True, **args)
        except FsError as exc:
            if not rows_refused(exc):
                raise
        ROWS_REFUSED.add(self.address)
        return None

    # ---- sessions (who holds files open) ----------------------------------

    async def session_open(
        self, client: str, host: str, pid: int, mount: MountInfo | None = None
    ) -> Session:
        result: Session = await self._call(
            "session_open", client=client, host=host, pid=pid, mount=mount
        )
        return result

    async def session_renew(self, session: int, open_ro: list[list[int]] | None = None) -> None:
        """ENOENT: the session expired (its handles were closed); open a new one.
        *open_ro*: the [ino, handle] of every read-only handle this client holds
        (the server keeps those in memory only; after a restart it learns them
        back from here, see docs/metadata.md "Read-only handles")."""
        await self._call("session_renew", session=session, open_ro=open_ro)

    async def sessions(self) -> list[SessionInfo]:
        """Every live session, with what each mount reported of itself
        (read-only: no write transaction)."""
        result: list[SessionInfo] = await self._call("sessions")
        return result

    async def session_close(self, session: int) -> None:
        """Close the session and every handle it still holds."""
        await self._call("session_close", session=session)

    # ---- names and attributes ---------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Attr:
        result: Attr = await self._call("lookup", parent=parent, name=name)
        return result

    async def getattr(self, ino: int) -> Attr:
        result: Attr = await self._call("getattr", ino=ino)
        return result

    async def getattrs(self, inos: list[int]) -> list[Attr | None]:
        """`getattr` of many inodes from one read snapshot (None: no such
        inode; at most READDIR_MAX): what a client's concurrent opens
        revalidate with together. ENOSYS from a server of before it."""
        result: list[Attr | None] = await self._call("getattrs", inos=inos)
        return result

    async def resolve(self, path: bytes, follow: bool = True) -> Attr:
        """Walk an absolute path from the root in one call, following symlinks
        in the middle (and at the end when *follow*); ELOOP after 40."""
        result: Attr = await self._call("resolve", path=path, follow=follow)
        return result

    async def setattr(
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
        """Change what is given (mode: permission bits only). A size change
        truncates or extends the file, chunks included; ctime becomes now.
        A shrink is carried out on the storage daemons before the reply; if
        they cannot be reached the reply is EIO, the new size stands and the
        cut is retried in the background."""
        args = {
            k: v
            for k, v in (
                ("mode", mode),
                ("uid", uid),
                ("gid", gid),
                ("size", size),
                ("atime", atime),
                ("mtime", mtime),
            )
            if v is not None
        }
        result: Attr = await self._call("setattr", ino=ino, **args)
        return result

    async def update_length(self, ino: int, length: int, mtime: int | None = None) -> Attr:
        """After writes: size = max(size, length); mtime (and ctime) become
        *mtime* (ns) when given. Writers call it on flush, fsync and close."""
        result: Attr = await self._call("update_length", ino=ino, length=length, mtime=mtime)
        return result

    # ---- creating and removing --------------------------------------------

    async def mknod(
        self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> Attr:
        result: Attr = await self._call(
            "mknod", parent=parent, name=name, mode=mode, rdev=rdev, uid=uid, gid=gid
        )
        return result

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        result: Attr = await self._call(
            "mkdir", parent=parent, name=name, mode=mode, uid=uid, gid=gid
        )
        return result

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int, session: int
    ) -> OpenResult:
        """Create and open a regular file. With O_EXCL in *flags* an existing
        name is EEXIST; without, the existing file is opened (and truncated
        with O_TRUNC); an existing directory is EISDIR, an existing symlink
        ELOOP (resolve it first). SESSION_EXPIRED if *session* is gone."""
        result: OpenResult = await self._call(
            "create",
            parent=parent,
            name=name,
            mode=mode,
            flags=flags,
            uid=uid,
            gid=gid,
            session=session,
        )
        return result

    async def create_files(self, files: list[NewFile], session: int) -> list[CreatedFile]:
        """`create` of many files (at most READDIR_MAX), each on its own,
        all in one group commit. ENOSYS from a server of before it."""
        result: list[CreatedFile] = await self._call("create_files", files=files, session=session)
        return result

    async def open(self, ino: int, flags: int, session: int) -> OpenResult:
        """Open an inode: fresh attributes (close-to-open), the layout, and a
        handle that keeps the file's data alive if it is unlinked meanwhile.
        O_TRUNC truncates a regular file. EISDIR for a directory opened for
        writing; SESSION_EXPIRED if *session* is gone. Opened for writing (or
        with O_TRUNC), EIO if the file has a truncation the storage daemons
        have not carried out yet and they are unreachable: a writer must never
        see the cut bytes come back."""
        result: OpenResult = await self._call("open", ino=ino, flags=flags, session=session)
        return result

    async def lookup_open(self, parent: int, name: bytes, session: int) -> OpenResult:
        """`lookup`, and for a regular file a read-only `open` of it, in one
        call: what a read-only mount's LOOKUP asks (its OPEN or first READ
        follows). Anything else comes with layout None and handle 0 (nothing
        to release). ENOSYS from a server of before it."""
        result: OpenResult = await self._call(
            "lookup_open", parent=parent, name=name, session=session
        )
        return result

    async def cache_watch(self, session: int, token: int, acked: int) -> CacheWatchReply:
        """The long poll of a client's cache watch (metadata/cache_watch.py):
        answered at once if there are changes it has not acknowledged, else
        after a second. *acked*: the `seq` of the last reply applied;
        *token*: that reply's (0 at first)."""
        result: CacheWatchReply = await self._call(
            "cache_watch", session=session, token=token, acked=acked
        )
        return result

    async def watch_dir(
        self, session: int, ino: int, limit: int = 256, names: bool = False
    ) -> WatchedDirPage:
        """The first page of directory *ino*, and a watch of its listing by
        *session*'s cache watch: its next change is told to that watch
        (once; metadata/cache_watch.py). Primary only. *names*: the client
        keeps directories' names from its own creates' replies (EINVAL,
        "unexpected argument 'names'", from a server of before)."""
        args: dict[str, object] = {"session": session, "ino": ino, "limit": limit}
        if names:
            args["names"] = True
        rows: WatchedDirRowsPage | None = await self._rows("watch_dir", args)
        if rows is not None:
            return {
                "entries": [entry_of_row(r) for r in rows["entries"]],
                "more": rows["more"],
                "attr": rows["attr"],
                "since": rows["since"],
            }
        result: WatchedDirPage = await self._call("watch_dir", **args)
        return result

    async def open_read_only(self, opens: list[list[int]], session: int) -> list[OpenResult | None]:
        """`open` of many [ino, flags] that neither write nor truncate, each
        with a handle of its own (None: no such inode; at most READDIR_MAX);
        any other failure fails the call (no handle is kept then). ENOSYS
        from a server of before it."""
        result: list[OpenResult | None] = await self._call(
            "open_read_only", opens=opens, session=session
        )
        return result

    async def release(self, ino: int, handle: int, session: int) -> None:
        """Close a handle; the last close of an unlinked file frees it.
        Releasing a handle that is already gone (its session expired) is not
        an error; one held by another session is EBADF."""
        await self._call("release", ino=ino, handle=handle, session=session)

    async def close_files(self, files: list[WrittenClose], session: int) -> list[ClosedFile]:
        """The closes of many handles open for writing (at most READDIR_MAX):
        each file's length reported (if asked) and its handle given back,
        each file on its own, all in one group commit. ENOSYS from a server
        of before it."""
        result: list[ClosedFile] = await self._call("close_files", files=files, session=session)
        return result

    async def release_read_only(self, handles: list[list[int]], session: int) -> None:
        """`release` of many read-only handles ([ino, handle] each) in one
        call; ENOSYS from a server of before it."""
        await self._call("release_read_only", handles=handles, session=session)

    async def unlink(self, parent: int, name: bytes) -> Attr | None:
        """The directory's attributes after it (None from a server of
        before them)."""
        result: Attr | None = await self._call("unlink", parent=parent, name=name)
        return result

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._call("rmdir", parent=parent, name=name)

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        """rename(2)/renameat2(2) semantics, RENAME_NOREPLACE and RENAME_EXCHANGE included."""
        await self._call(
            "rename",
            parent=parent,
            name=name,
            new_parent=new_parent,
            new_name=new_name,
            flags=flags,
        )

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        result: Attr = await self._call("link", ino=ino, new_parent=new_parent, new_name=new_name)
        return result

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        result: Attr = await self._call(
            "symlink", parent=parent, name=name, target=target, uid=uid, gid=gid
        )
        return result

    async def readlink(self, ino: int) -> bytes:
        result: bytes = await self._call("readlink", ino=ino)
        return result

    async def readdir(self, ino: int, after: bytes | None = None, limit: int = 256) -> ReaddirPage:
        """One page of a directory in name order, starting after *after*:
        stable under concurrent inserts and removals (nothing is skipped or
        repeated that existed throughout the listing). At most READDIR_MAX
        entries per page."""
        rows = await self.readdir_rows(ino, after, limit)
        if rows is not None:
            return {"entries": [entry_of_row(r) for r in rows["entries"]], "more": rows["more"]}
        result: ReaddirPage = await self._call("readdir", ino=ino, after=after, limit=limit)
        return result

    async def readdir_rows(
        self, ino: int, after: bytes | None = None, limit: int = 256
    ) -> ReaddirRowsPage | None:
        """`readdir`'s page as the server sends it (each entry a row:
        metadata/listing_rows.py), for callers that keep a few fields of
        many entries; None from a server that sends no rows."""
        rows: ReaddirRowsPage | None = await self._rows(
            "readdir", {"ino": ino, "after": after, "limit": limit}
        )
        return rows

    async def readdir_layouts(
        self, ino: int, after: bytes | None = None, limit: int = 256
    ) -> ReaddirLayoutsPage:
        """`readdir` with each regular file's layout (None for other kinds):
        one request per page lets a reader read every file of a directory
        without opening each (read-only: no write transaction)."""
        result: ReaddirLayoutsPage = await self._call(
            "readdir_layouts", ino=ino, after=after, limit=limit
        )
        return result

    async def list_files(self, after: int = 0, limit: int = 1024) -> FilesPage:
        """Every regular file's (inode, size, layout) by inode after *after*,
        named or not (read-only: no write transaction; `shufflefs fsck`)."""
        result: FilesPage = await self._call("list_files", after=after, limit=limit)
        return result

    async def pending_jobs(
        self, kind: Literal["gc", "truncate"], after: int = 0, limit: int = 256
    ) -> list[PendingJob]:
        """A page of the GC or truncate jobs not yet carried out, by inode."""
        result: list[PendingJob] = await self._call(
            "pending_jobs", kind=kind, after=after, limit=limit
        )
        return result

    async def statfs(self) -> FsStats:
        result: FsStats = await self._call("statfs")
        return result

    async def routing_version(self) -> int:
        """The routing map version the server lays out new files by."""
        return int(await self._call("routing_version"))

    # ---- extended attributes ----------------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """ENODATA if absent."""
        result: bytes = await self._call("getxattr", ino=ino, name=name)
        return result

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """XATTR_CREATE: EEXIST if present; XATTR_REPLACE: ENODATA if absent."""
        await self._call("setxattr", ino=ino, name=name, value=value, flags=flags)

    async def listxattr(self, ino: int) -> list[bytes]:
        result: list[bytes] = await self._call("listxattr", ino=ino)
        return result

    async def removexattr(self, ino: int, name: bytes) -> None:
        """ENODATA if absent."""
        await self._call("removexattr", ino=ino, name=name)
