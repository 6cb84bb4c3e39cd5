"""pyfuse3 operations over the client library.

Kernel caching policy (close-to-open, like NFS):

* attributes and entries are cached for ``attr_timeout``/``entry_timeout``;
* on every open the metadata server is asked for fresh attributes; if the
  file changed since this mount last cached its data (size, mtime or ctime
  differ) the kernel's page cache for it is dropped (``keep_cache=False``)
  and its cached attributes invalidated, else the page cache is kept, so
  re-reading unchanged training data costs no network round trip;
* a file written through this mount drops its cache marker on release, so
  the next open re-validates.

Errors: every handler turns FsError into ``FUSEError(errno)``; ENOSYS is
sent as EIO, because the kernel would take ENOSYS to mean "never call this
operation again" for the rest of the mount.
"""

from __future__ import annotations

import errno
import functools
import logging
import stat
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from shufflefs.client.fs import FileSystem
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError, as_fs_error

log = logging.getLogger("shufflefs.fuse")

P = ParamSpec("P")
R = TypeVar("R")

BLOCK_SIZE = 4096  # st_blksize: small, so buffered readers do not turn a 2 KiB read into 1 MiB
READDIR_PAGE = 256


@dataclass
class MountOptions:
    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    max_tasks: int = 64


def fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn any failure into FUSEError(errno), logging what is unexpected."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            code = errno.EIO if exc.code == errno.ENOSYS else exc.code
            if code == errno.EIO:
                log.error("%s: %s", fn.__name__, exc.message)
            raise pyfuse3.FUSEError(code) from None
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(as_fs_error(exc).code) from None

    return wrapper


@dataclass
class DirHandle:
    ino: int
    parent: int
    cursors: dict[int, bytes | None] = field(
        default_factory=dict
    )  # next_id -> name to resume after
    pending: list[tuple[bytes, Attr]] = field(default_factory=list)  # fetched, not yet taken
    pending_after: bytes | None = None
    pending_more: bool = False
    next_id: int = 3  # 1 and 2 are '.' and '..'


class ShuffleOps(pyfuse3.Operations):
    def __init__(self, fs: FileSystem, options: MountOptions | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.options = options or MountOptions()
        self.lookups: dict[int, int] = {}  # inode -> the kernel's lookup count
        self.cached: dict[
            int, tuple[int, int, int]
        ] = {}  # inode -> (size, mtime, ctime) of its cached data
        self.dirs: dict[int, DirHandle] = {}
        self._next_dir = 1

    # ---- conversions ----------------------------------------------------------

    def entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = attr["ino"]
        e.generation = 0
        e.entry_timeout = self.options.entry_timeout
        e.attr_timeout = self.options.attr_timeout
        e.st_mode = attr["mode"]
        e.st_nlink = attr["nlink"]
        e.st_uid = attr["uid"]
        e.st_gid = attr["gid"]
        e.st_rdev = attr["rdev"]
        e.st_size = attr["size"]
        e.st_blksize = BLOCK_SIZE
        e.st_blocks = (attr["size"] + 511) // 512
        e.st_atime_ns = attr["atime"]
        e.st_mtime_ns = attr["mtime"]
        e.st_ctime_ns = attr["ctime"]
        return e

    def remember(self, attr: Attr) -> pyfuse3.EntryAttributes:
        """An entry handed to the kernel: its lookup count rises by one."""
        ino = attr["ino"]
        self.lookups[ino] = self.lookups.get(ino, 0) + 1
        return self.entry(attr)

    # ---- names and attributes ------------------------------------------------------

    @fuse_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            left = self.lookups.get(ino, 0) - n
            if left > 0:
                self.lookups[ino] = left
            else:
                self.lookups.pop(ino, None)
                self.cached.pop(ino, None)

    @fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entry(await self.fs.getattr(inode))

    @fuse_errors
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        new = await self.fs.setattr(
            inode,
            mode=stat.S_IMODE(attr.st_mode) if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime=attr.st_atime_ns if fields.update_atime else None,
            mtime=attr.st_mtime_ns if fields.update_mtime else None,
        )
        if fields.update_size:
            self.cached.pop(inode, None)
        return self.entry(new)

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        capacity, stats = await self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLOCK_SIZE
        s.f_frsize = BLOCK_SIZE
        s.f_blocks = capacity["capacity"] // BLOCK_SIZE
        s.f_bfree = capacity["free"] // BLOCK_SIZE
        s.f_bavail = capacity["free"] // BLOCK_SIZE
        s.f_files = stats["max_files"]
        s.f_ffree = max(0, stats["max_files"] - stats["files"])
        s.f_favail = s.f_ffree
        s.f_namemax = 255
        return s

    # ---- creating and removing -------------------------------------------------

    @fuse_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @fuse_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.link(inode, new_parent_inode, new_name))

    @fuse_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(inode)

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.unlink(parent_inode, name)

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(parent_inode, name)

    @fuse_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # ---- files ------------------------------------------------------------------

    def file_info(self, fh: int, attr: Attr) -> pyfuse3.FileInfo:
        """keep_cache only if the data the kernel may hold is still current."""
        ino = attr["ino"]
        version = (attr["size"], attr["mtime"], attr["ctime"])
        previous = self.cached.get(ino)
        keep = previous == version
        if previous is not None and not keep:
            try:  # cached attributes (i_size) are stale too
                pyfuse3.invalidate_inode(ino, attr_only=True)
            except OSError as exc:
                log.debug("invalidate_inode(%d): %s", ino, exc)
        self.cached[ino] = version
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=False)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        f, attr = await self.fs.open(inode, flags)
        return self.file_info(f.fh, attr)

    @fuse_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        f, attr = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return self.file_info(f.fh, attr), self.remember(attr)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = await self.fs.read(fh, off, size)
        return data if isinstance(data, bytes) else bytes(data)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(fh, off, buf)

    @fuse_errors
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh)

    @fuse_errors
    async def release(self, fh: int) -> None:
        f = self.fs.files.get(fh)
        if f is not None and f.writable:
            self.cached.pop(f.ino, None)
        await self.fs.release(fh)

    # ---- directories ------------------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        attr = await self.fs.getattr(inode)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, "not a directory")
        fh = self._next_dir
        self._next_dir += 1
        self.dirs[fh] = DirHandle(inode, attr["parent"] or inode)
        return fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        h = self.dirs.get(fh)
        if h is None:
            raise FsError(errno.EBADF, "directory not open")
        if start_id == 0:
            attr = await self.fs.getattr(h.ino)
            if not pyfuse3.readdir_reply(token, b".", self.entry(attr), 1):
                return
            start_id = 1
        if start_id == 1:
            attr = await self.fs.getattr(h.parent)
            if not pyfuse3.readdir_reply(token, b"..", self.entry(attr), 2):
                return
            after: bytes | None = None
        elif start_id == 2:
            after = None
        else:
            if start_id not in h.cursors:
                raise FsError(errno.EINVAL, f"stale directory offset {start_id}")
            after = h.cursors[start_id]
        while True:
            if h.pending and h.pending_after == after:
                entries, more = h.pending, h.pending_more
            else:
                page = await self.fs.readdir(h.ino, after, READDIR_PAGE)
                entries, more = page["entries"], page["more"]
            for i, (name, attr) in enumerate(entries):
                next_id = h.next_id
                if not pyfuse3.readdir_reply(token, name, self.entry(attr), next_id):
                    h.pending, h.pending_after, h.pending_more = entries[i:], after, more
                    return
                h.next_id += 1
                h.cursors[next_id] = name
                self.lookups[attr["ino"]] = self.lookups.get(attr["ino"], 0) + 1
                after = name
            h.pending = []
            if not more or not entries:
                return

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    # ---- extended attributes -------------------------------------------------------

    @fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.getxattr(inode, name)

    @fuse_errors
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        # pyfuse3 checks XATTR_CREATE/XATTR_REPLACE itself (with getxattr)
        # before calling us, so what is left is a plain set
        await self.fs.setxattr(inode, name, value, 0)

    @fuse_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.fs.listxattr(inode)

    @fuse_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.removexattr(inode, name)
