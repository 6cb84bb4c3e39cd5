"""The path-level operations of the native API, over `FileSystem`'s inode
ones (a base of it): resolve, open or create by path, list a directory."""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from typing import TYPE_CHECKING

from shufflefs.client.paths import current_umask, normalize
from shufflefs.metadata.protocol import ROOT_INODE, Attr, ReaddirPage
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.client.fs import OpenFile
    from shufflefs.client.meta_client import MetaClient

ACCESS_MODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR


class PathOps:
    """Paths resolved by the metadata server, then the inode operations."""

    if TYPE_CHECKING:
        meta: MetaClient

        def overlay(self, attr: Attr) -> Attr: ...
        async def getattr(self, ino: int) -> Attr: ...
        async def setattr(self, ino: int, *, size: int | None = None) -> Attr: ...
        async def create(
            self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int
        ) -> tuple[OpenFile, Attr]: ...
        async def open(self, ino: int, flags: int) -> tuple[OpenFile, Attr]: ...
        async def readdir(self, ino: int, after: bytes | None, limit: int) -> ReaddirPage: ...

    async def resolve(self, path: str | bytes, follow: bool = True) -> Attr:
        p = normalize(path)
        if p == b"/":
            return await self.getattr(ROOT_INODE)
        return self.overlay(await self.meta.call_read("resolve", lambda m: m.resolve(p, follow)))

    async def parent_of(self, path: str | bytes) -> tuple[int, bytes]:
        """(parent inode, name) of a path that need not exist."""
        p = normalize(path)
        head, name = posixpath.split(p)
        if not name:
            raise FsError(errno.EINVAL, "the root has no parent")
        parent = await self.resolve(head)
        if not stat.S_ISDIR(parent["mode"]):
            raise FsError(errno.ENOTDIR, f"{os.fsdecode(head)} is not a directory")
        return parent["ino"], name

    async def open_path(
        self, path: str | bytes, flags: int, mode: int = 0o666
    ) -> tuple[OpenFile, Attr]:
        uid, gid = os.getuid(), os.getgid()
        if flags & os.O_CREAT:
            parent, name = await self.parent_of(path)
            f, attr = await self.create(parent, name, mode & ~current_umask(), flags, uid, gid)
        else:
            attr = await self.resolve(path)
            if stat.S_ISDIR(attr["mode"]) and flags & ACCESS_MODE != os.O_RDONLY:
                raise FsError(errno.EISDIR, f"{os.fsdecode(normalize(path))} is a directory")
            f, attr = await self.open(attr["ino"], flags)
            if flags & os.O_TRUNC and f.writable and attr["size"]:
                attr = await self.setattr(f.ino, size=0)
        return f, attr

    async def listdir(self, path: str | bytes) -> list[bytes]:
        attr = await self.resolve(path)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, f"{os.fsdecode(normalize(path))} is not a directory")
        names: list[bytes] = []
        after: bytes | None = None
        while True:
            page = await self.readdir(attr["ino"], after, 1024)
            names.extend(name for name, _ in page["entries"])
            if not page["more"] or not page["entries"]:
                return names
            after = page["entries"][-1][0]
