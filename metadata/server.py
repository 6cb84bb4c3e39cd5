"""The metadata server: the namespace (`store.NamespaceStore`) behind the rpc layer.

Reads are served inline from an LMDB read transaction (a memory-mapped B-tree
lookup: no reason to leave the event loop). Mutations run in a worker thread
(`Writer`), one LMDB write transaction each. What a mutation owes the storage
daemons is carried out by `gc.StorageJobs`: a shrink before the reply (so a
client never sees cut bytes again), chunk deletion in the background.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import stat
from typing import Any

from shufflefs.metadata.handles_service import SessionsAndHandles
from shufflefs.metadata.listing_rows import ReaddirRowsPage
from shufflefs.metadata.protocol import (
    READDIR_MAX,
    Attr,
    CreatedFile,
    FilesPage,
    FsStats,
    Layout,
    NewFile,
    OpenResult,
    PendingJob,
    ReaddirLayoutsPage,
    ReaddirPage,
)
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.schema import rpc_method

log = logging.getLogger("shufflefs.metadata.server")


class MetaService(SessionsAndHandles):
    """The rpc methods of `metadata.stub.MetaStub`, over one NamespaceStore.

    *routing* returns the current routing map; it is consulted for the chains
    of new files and for the storage targets that jobs are carried out on.
    """

    @rpc_method(inline=True)
    async def meta_role(self) -> dict[str, Any]:
        """This server's role, epoch and log position (status, tests)."""
        position = self.store.txns.position()
        primary = self.role is None or self.role.primary_now()
        return {
            "role": "primary" if primary else "follower",
            "epoch": position.epoch,
            "applied_seq": position.applied_seq,
            "applied_epoch": position.applied_epoch,
        }

    def new_layout(self) -> Layout:
        """The layout of a file created now: up to `stripe` writable chains
        starting at a rotating offset. Called inside a write transaction, so
        it must not block: it only reads the routing snapshot."""
        routing = self.routing()
        chains = routing.writable_chains()
        if not chains:
            minimum = routing.config["min_replicas"]
            enough = [c for c in routing.chains if len(routing.serving_targets(c)) >= minimum]
            if routing.chains and not enough:
                # chains are there but too degraded: refusing beats writing fewer copies
                raise FsError(
                    errno.EROFS,
                    f"no storage chain has {minimum} serving replicas (min_replicas): "
                    "new files are refused until failed storage nodes are back",
                )
            raise FsError(errno.ENOSPC, "no writable storage chains")
        n = len(chains)
        count = min(max(1, routing.config["stripe"]), n)
        start = next(self._rotor) % n
        return {
            "chunk_size": routing.config["chunk_size"],
            "chains": [chains[(start + i) % n] for i in range(count)],
        }

    async def _ensure_chains(self) -> None:
        """Before creating a file: if our routing snapshot has no writable
        chain, it may just be older than the storage nodes' registration
        (right after a cluster start); fetch a fresh one before saying ENOSPC."""
        if self.refresh_routing is not None and not self.routing().writable_chains():
            with contextlib.suppress(FsError):
                await self.refresh_routing()

    # ---- names and attributes -------------------------------------------------

    @rpc_method(inline=True)
    async def lookup(self, parent: int, name: bytes) -> Attr:
        return self.store.lookup(parent, name)

    @rpc_method(inline=True)
    async def getattr(self, ino: int) -> Attr:
        return self.store.getattr(ino)

    @rpc_method(inline=True)
    async def getattrs(self, inos: list[int]) -> list[Attr | None]:
        return self.store.getattrs(inos)

    @rpc_method(inline=True)
    async def resolve(self, path: bytes, follow: bool = True) -> Attr:
        return self.store.resolve(path, follow)

    @rpc_method
    async def setattr(
        self,
        ino: int,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime: int | None = None,
        mtime: int | None = None,
        request: list[int] | None = None,
    ) -> Attr:
        attr = await self._mutate(
            "setattr",
            self.store.setattr,
            request=request,
            ino=ino,
            mode=mode,
            uid=uid,
            gid=gid,
            size=size,
            atime=atime,
            mtime=mtime,
        )
        if size is not None:
            await self.jobs.truncate_now(ino)
        return attr

    @rpc_method
    async def update_length(
        self, ino: int, length: int, mtime: int | None = None, request: list[int] | None = None
    ) -> Attr:
        return await self._mutate(
            "update_length",
            self.store.update_length,
            request=request,
            ino=ino,
            length=length,
            mtime=mtime,
        )

    # ---- creating and removing ------------------------------------------------

    @rpc_method
    async def mknod(
        self,
        parent: int,
        name: bytes,
        mode: int,
        rdev: int,
        uid: int,
        gid: int,
        request: list[int] | None = None,
    ) -> Attr:
        if stat.S_ISREG(mode):
            await self._ensure_chains()
        return await self._mutate(
            "mknod",
            self.store.mknod,
            request=request,
            parent=parent,
            name=name,
            mode=mode,
            rdev=rdev,
            uid=uid,
            gid=gid,
            layout=self.new_layout,
        )

    @rpc_method
    async def mkdir(
        self,
        parent: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        request: list[int] | None = None,
    ) -> Attr:
        return await self._mutate(
            "mkdir",
            self.store.mkdir,
            request=request,
            parent=parent,
            name=name,
            mode=mode,
            uid=uid,
            gid=gid,
        )

    @rpc_method
    async def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        flags: int,
        uid: int,
        gid: int,
        session: int,
        request: list[int] | None = None,
    ) -> OpenResult:
        await self._ensure_chains()
        result = await self._mutate(
            "create",
            self.store.create,
            request=request,
            parent=parent,
            name=name,
            mode=mode,
            flags=flags,
            uid=uid,
            gid=gid,
            session=session,
            layout=self.new_layout,
        )
        return await self._settle_open(result, flags, session)

    @rpc_method
    async def create_files(
        self, files: list[NewFile], session: int, request: list[int] | None = None
    ) -> list[CreatedFile]:
        """Many files' creates in one call and one group commit (what a
        client's overlapping creates send together: `shufflefs import`,
        several writers on a mount): each answered on its own."""
        if len(files) > READDIR_MAX:
            raise FsError(errno.E2BIG, f"create_files: {len(files)} files, at most {READDIR_MAX}")
        await self._ensure_chains()
        created = await self._mutate(
            "create_files",
            self.store.create_files,
            request=request,
            files=files,
            session=session,
            layout=self.new_layout,
        )
        for f, c in zip(files, created, strict=True):
            if c["opened"] is not None:
                try:
                    await self._settle_open(c["opened"], f["flags"], session)
                except FsError as exc:
                    c["opened"], c["error"] = None, exc.to_wire()
        return created

    @rpc_method
    async def unlink(self, parent: int, name: bytes, request: list[int] | None = None) -> Attr:
        """The directory's attributes after it: the kernel drops its cached
        ones and asks for them before the next unlink in it (a round trip
        per file of an ``rm -r`` otherwise)."""
        done = await self._mutate(
            "unlink", self.store.unlink, request=request, parent=parent, name=name
        )
        if done["freed"]:
            self.jobs.wake()
        return done["parent_attr"]

    @rpc_method
    async def rmdir(self, parent: int, name: bytes, request: list[int] | None = None) -> None:
        await self._mutate("rmdir", self.store.rmdir, request=request, parent=parent, name=name)

    @rpc_method
    async def rename(
        self,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
        request: list[int] | None = None,
    ) -> None:
        freed = await self._mutate(
            "rename",
            self.store.rename,
            request=request,
            parent=parent,
            name=name,
            new_parent=new_parent,
            new_name=new_name,
            flags=flags,
        )
        if freed:
            self.jobs.wake()

    @rpc_method
    async def link(
        self, ino: int, new_parent: int, new_name: bytes, request: list[int] | None = None
    ) -> Attr:
        return await self._mutate(
            "link",
            self.store.link,
            request=request,
            ino=ino,
            new_parent=new_parent,
            new_name=new_name,
        )

    @rpc_method
    async def symlink(
        self,
        parent: int,
        name: bytes,
        target: bytes,
        uid: int,
        gid: int,
        request: list[int] | None = None,
    ) -> Attr:
        return await self._mutate(
            "symlink",
            self.store.symlink,
            request=request,
            parent=parent,
            name=name,
            target=target,
            uid=uid,
            gid=gid,
        )

    @rpc_method(inline=True)
    async def readlink(self, ino: int) -> bytes:
        return self.store.readlink(ino)

    @rpc_method(inline=True)
    async def readdir(
        self, ino: int, after: bytes | None = None, limit: int = 256, rows: bool = False
    ) -> ReaddirPage | ReaddirRowsPage:
        """*rows*: each entry as a row (metadata/listing_rows.py, ATTR_ROW)."""
        if rows:
            return self.store.readdir_rows(ino, after, limit)
        return self.store.readdir(ino, after, limit)

    @rpc_method(inline=True)
    async def readdir_layouts(
        self, ino: int, after: bytes | None = None, limit: int = 256
    ) -> ReaddirLayoutsPage:
        return self.store.readdir_layouts(ino, after, limit)

    @rpc_method(inline=True)
    async def list_files(self, after: int = 0, limit: int = 1024) -> FilesPage:
        return self.store.files_page(after, limit)

    @rpc_method(inline=True)
    async def pending_jobs(self, kind: str, after: int = 0, limit: int = 256) -> list[PendingJob]:
        """The GC or truncate jobs still owed to storage (`shufflefs fsck`
        must not call their chunks orphans)."""
        limit = max(1, min(limit, 4096))
        if kind == "gc":
            return [
                {"ino": j["ino"], "size": 0, "layout": j["layout"]}
                for j in self.store.gc_jobs(after, limit)
            ]
        if kind == "truncate":
            return [
                {"ino": j["ino"], "size": j["size"], "layout": j["layout"]}
                for j in self.store.truncate_jobs(after, limit)
            ]
        raise FsError(errno.EINVAL, f"unknown job kind {kind!r} (gc or truncate)")

    @rpc_method(inline=True)
    async def statfs(self) -> FsStats:
        return self.store.statfs()

    @rpc_method(inline=True)
    async def routing_version(self) -> int:
        """The version of the routing map this server lays new files out by
        (the launcher waits for it to catch up with mgmtd before mounting)."""
        return self.routing().version

    # ---- extended attributes --------------------------------------------------

    @rpc_method(inline=True)
    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.store.getxattr(ino, name)

    @rpc_method
    async def setxattr(
        self, ino: int, name: bytes, value: bytes, flags: int = 0, request: list[int] | None = None
    ) -> None:
        await self._mutate(
            "setxattr",
            self.store.setxattr,
            request=request,
            ino=ino,
            name=name,
            value=value,
            flags=flags,
        )

    @rpc_method(inline=True)
    async def listxattr(self, ino: int) -> list[bytes]:
        return self.store.listxattr(ino)

    @rpc_method
    async def removexattr(self, ino: int, name: bytes, request: list[int] | None = None) -> None:
        await self._mutate(
            "removexattr", self.store.removexattr, request=request, ino=ino, name=name
        )
