"""The metadata server's typed client stub: one method per RPC, with the
message shapes of `metadata/protocol.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from shufflefs.metadata.listing_rows import (
    ROWS_REFUSED,
    ReaddirRowsPage,
    WatchedDirRowsPage,
    entry_of_row,
    rows_refused,
)
from shufflefs.metadata.protocol import (
    MUTATIONS,
    Attr,
    CacheWatchReply,
    ClosedFile,
    CreatedFile,
    FilesPage,
    FsStats,
    MountInfo,
    NewFile,
    OpenResult,
    PendingJob,
    ReaddirLayoutsPage,
    ReaddirPage,
    Session,
    SessionInfo,
    WatchedDirPage,
    WrittenClose,
)
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError


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
