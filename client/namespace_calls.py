"""The namespace calls of `FileSystem` (a base of it): statfs, mkdir, link,
unlink, rename, listings, xattrs: each one metadata call, its attributes
laid over by this client's own (`FileSystem.overlay`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from shufflefs.cluster.protocol import Capacity
from shufflefs.metadata.listing_rows import ReaddirRowsPage
from shufflefs.metadata.protocol import Attr, FsStats, ReaddirLayoutsPage, ReaddirPage

if TYPE_CHECKING:
    from shufflefs.client.cache_watch import CacheWatch
    from shufflefs.client.meta_client import MetaClient
    from shufflefs.client.open_cache import OpenCache
    from shufflefs.client.write_behind import InodeState, LastAttrs
    from shufflefs.cluster.routing import RoutingCache


class NamespaceCalls:
    if TYPE_CHECKING:
        meta: MetaClient
        routing: RoutingCache
        cache_watch: CacheWatch | None
        inodes: dict[int, InodeState]

        open_cache: OpenCache
        last_attrs: LastAttrs

        def overlay(self, attr: Attr) -> Attr: ...

    def overlay_entries(self, entries: Iterable[tuple[bytes, Attr]]) -> list[tuple[bytes, Attr]]:
        """`overlay` of a listing's entries: the files this client holds
        nothing of (most of a large listing) pass as they are, without the
        call per entry."""
        held, inodes, kept = self.open_cache.entries, self.inodes, self.last_attrs.inodes()
        return [
            (
                name,
                self.overlay(a)
                if a["ino"] in held or a["ino"] in inodes or a["ino"] in kept
                else a,
            )
            for name, a in entries
        ]

    async def statfs(self) -> tuple[Capacity, FsStats]:
        capacity = await self.routing.mgmtd.capacity()
        stats = await self.meta.call_read("statfs", lambda m: m.statfs())
        return capacity, stats

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        self._dirs_changing(parent)
        return await self.meta.call_at_most_once(
            "mkdir", lambda m: m.mkdir(parent, name, mode, uid, gid)
        )

    async def mknod(
        self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> Attr:
        self._dirs_changing(parent)
        return await self.meta.call_at_most_once(
            "mknod", lambda m: m.mknod(parent, name, mode, rdev, uid, gid)
        )

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        self._dirs_changing(parent)
        return await self.meta.call_at_most_once(
            "symlink", lambda m: m.symlink(parent, name, target, uid, gid)
        )

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        self._dirs_changing(new_parent)
        attr = await self.meta.call_at_most_once(
            "link", lambda m: m.link(ino, new_parent, new_name)
        )
        return self.overlay(attr)

    async def readlink(self, ino: int) -> bytes:
        return await self.meta.call_read("readlink", lambda m: m.readlink(ino))

    async def unlink(self, parent: int, name: bytes) -> Attr | None:
        """The directory's attributes after it (None from a server of
        before them)."""
        self._dirs_changing(parent)
        parent_attr: Attr | None = await self.meta.call_at_most_once(
            "unlink", lambda m: m.unlink(parent, name)
        )
        self._attrs_changed()
        return parent_attr

    async def rmdir(self, parent: int, name: bytes) -> None:
        self._dirs_changing(parent)
        await self.meta.call_at_most_once("rmdir", lambda m: m.rmdir(parent, name))

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        self._dirs_changing(parent, new_parent)
        await self.meta.call_at_most_once(
            "rename", lambda m: m.rename(parent, name, new_parent, new_name, flags)
        )
        self._attrs_changed()

    async def readdir_layouts(
        self, ino: int, after: bytes | None, limit: int
    ) -> ReaddirLayoutsPage:
        page = await self.meta.call_read(
            "readdir_layouts", lambda m: m.readdir_layouts(ino, after, limit)
        )
        page["entries"] = [(n, self.overlay(a), lay) for n, a, lay in page["entries"]]
        return page

    async def readdir_rows(
        self, ino: int, after: bytes | None, limit: int
    ) -> ReaddirRowsPage | None:
        """A page of directory *ino* as rows, none of this client's unreported
        lengths laid over them; None from a server of before rows."""
        return await self.meta.call_read("readdir", lambda m: m.readdir_rows(ino, after, limit))

    async def readdir(
        self, ino: int, after: bytes | None, limit: int, watch: bool = False
    ) -> ReaddirPage:
        """A page of directory *ino*; *watch* (a first page): the cache watch
        keeps the listing fresh from here if it can (`CacheWatch.dir_attr`)."""
        watched = None
        if watch and after is None and self.cache_watch is not None:
            watched = await self.cache_watch.watch_dir(ino, limit)
        page: ReaddirPage = (
            await self.meta.call_read("readdir", lambda m: m.readdir(ino, after, limit))
            if watched is None
            else {"entries": watched["entries"], "more": watched["more"]}
        )
        return {
            "entries": self.overlay_entries(page["entries"]),
            "more": page["more"],
        }

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.meta.call_read("getxattr", lambda m: m.getxattr(ino, name))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        await self.meta.call_at_most_once("setxattr", lambda m: m.setxattr(ino, name, value, flags))
        self._attrs_changed()

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.meta.call_read("listxattr", lambda m: m.listxattr(ino))

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.meta.call_at_most_once("removexattr", lambda m: m.removexattr(ino, name))
        self._attrs_changed()

    def _dirs_changing(self, *dirs: int) -> None:
        """This client changes *dirs* (not by a create, or a create whose
        outcome is not known): the listings and names the cache watch held
        of them may be wrong from here (`CacheWatch.changing`)."""
        if self.cache_watch is not None:
            self.cache_watch.changing(dirs)

    def _attrs_changed(self) -> None:
        """A change by this client that no reply told of (an unlink's nlink,
        a rename's or an xattr's ctime): `written_attr` asks the server again."""
        for st in self.inodes.values():
            st.outdated()
