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
import functools
import itertools
import logging
import random
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from shufflefs.cluster.routing import Routing
from shufflefs.metadata import request_ids
from shufflefs.metadata.files import opens_for_writing
from shufflefs.metadata.gc import SessionReaper, StorageJobs
from shufflefs.metadata.protocol import (
    READDIR_MAX,
    Attr,
    FilesPage,
    FsStats,
    Layout,
    MountInfo,
    OpenResult,
    PendingJob,
    ReaddirLayoutsPage,
    ReaddirPage,
    Session,
    SessionInfo,
    is_read_only_handle,
)
from shufflefs.metadata.readonly import FreeInProgress
from shufflefs.metadata.replication_role import MetaRole
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.writer import Writer
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.schema import rpc_method
from shufflefs.storage.protocol import FORWARD_TIMEOUT

log = logging.getLogger("shufflefs.metadata.server")

T = TypeVar("T")


def _kv(details: dict[str, Any]) -> str:
    parts = []
    for key, value in details.items():
        if callable(value):
            continue
        text = repr(value)
        parts.append(f"{key}={text[:80]}")
    return " ".join(parts)


class MetaService:
    """The rpc methods of `metadata.protocol.MetaStub`, over one NamespaceStore.

    *routing* returns the current routing map; it is consulted for the chains
    of new files and for the storage targets that jobs are carried out on.
    """

    def __init__(
        self,
        store: NamespaceStore,
        routing: Callable[[], Routing],
        rpc: RpcClient,
        *,
        storage_timeout: float = FORWARD_TIMEOUT,  # per replica, as the daemons forward
        reap_interval: float | None = None,
        refresh_routing: Callable[[], Awaitable[object]] | None = None,
        role: MetaRole | None = None,
    ) -> None:
        self.store = store
        self.routing = routing
        self.refresh_routing = refresh_routing
        self.role = role
        self.write = (
            Writer(store.txns)
            if role is None
            else Writer(store.txns, gate=role.check_writable, durable=role.durable)
        )
        self.jobs = StorageJobs(
            store,
            self.write,
            routing,
            rpc,
            refresh_routing=refresh_routing,
            forward_timeout=storage_timeout,
        )
        if reap_interval is None:
            reap_interval = max(0.05, min(5.0, store.session_timeout / 4))
        self.reaper = SessionReaper(store, self.write, self.jobs, reap_interval)
        # New files start on successive chains, so single-chunk files spread
        # over all of them; a random start keeps restarts from favouring chain 0.
        self._rotor = itertools.count(random.randrange(1 << 16))

    async def run_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The storage-job worker and the session reaper, until cancelled;
        with a role, only while this server is the primary."""
        if self.role is not None:
            await self.role.run(self._primary_duties, task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.jobs.run)
            nursery.start_soon(self.reaper.run)
            task_status.started()

    async def _primary_duties(self) -> None:
        """A new primary (also a restarted one) gives every session a fresh
        lease and starts the restart grace (the read-only handles were in
        another process's memory), then carries out jobs and reaps."""
        sessions = await self.write(self.store.restart_leases)
        log.info("serving as primary: %d sessions get a fresh lease", sessions)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.jobs.run)
            nursery.start_soon(self.reaper.run)
            while True:
                await trio.sleep(request_ids.TRIM_INTERVAL)
                await self.write(request_ids.trim, self.store.txns)

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

    async def _mutate(
        self, op: str, fn: Callable[..., T], request: list[int] | None = None, **args: Any
    ) -> T:
        """Run a mutation through the writer; with a *request* id, at most
        once however often it is retried (`request_ids.py`)."""
        call = fn if request is None else functools.partial(self._once, request, fn)
        try:
            return await self.write(call, **args)
        except FsError as exc:
            log.debug("%s failed %s: %s", op, _kv(args), exc.message)
            raise

    def _once(self, request: list[int], fn: Callable[..., T], **args: Any) -> T:
        return request_ids.run_once(self.store.txns, request, functools.partial(fn, **args))

    async def _settle_open(self, result: OpenResult, flags: int, session: int) -> OpenResult:
        """A writer must not get a file whose cut is still owed to storage:
        the bytes cut would reappear under its writes. Carry the cut out now;
        if that fails, give the handle back and fail the open. (A file this
        create made was never cut: inode numbers are never reused.)"""
        ino = result["attr"]["ino"]
        if not opens_for_writing(flags) or result.get("created"):
            return result
        try:
            await self.jobs.truncate_now(ino)
        except FsError as exc:
            with trio.CancelScope(shield=True):
                await self.write(self.store.release, ino, result["handle"], session)
            log.debug("open ino=%d failed: %s", ino, exc.message)
            raise
        return result

    # ---- sessions -------------------------------------------------------------

    @rpc_method
    async def session_open(
        self,
        client: str,
        host: str,
        pid: int,
        mount: MountInfo | None = None,
        request: list[int] | None = None,
    ) -> Session:
        result = await self._mutate(
            "session_open",
            self.store.session_open,
            request=request,
            client=client,
            host=host,
            pid=pid,
            mount=mount,
        )
        log.info(
            "session opened session=%d client=%s host=%s pid=%d",
            result["session"],
            client,
            host,
            pid,
        )
        return result

    @rpc_method
    async def session_renew(
        self, session: int, open_ro: list[list[int]] | None = None, request: list[int] | None = None
    ) -> None:
        """The first renewal after a restart also hands back the read-only
        handles the client holds (kept in memory only: `readonly.py`)."""
        await self._mutate(
            "session_renew", self.store.session_renew, request=request, session=session
        )
        pairs = [(p[0], p[1]) for p in open_ro or [] if len(p) == 2]
        self.store.read_only.renewed(session, pairs)
        await self.reaper.sweep_if_due()

    @rpc_method(inline=True)
    async def sessions(self) -> list[SessionInfo]:
        return self.store.sessions()

    @rpc_method
    async def session_close(self, session: int, request: list[int] | None = None) -> None:
        handles, freed = await self._mutate(
            "session_close", self.store.session_close, request=request, session=session
        )
        log.info("session closed session=%d handles=%d freed=%d", session, handles, freed)
        if freed:
            self.jobs.wake()

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
    async def open(
        self, ino: int, flags: int, session: int, request: list[int] | None = None
    ) -> OpenResult:
        if not opens_for_writing(flags):
            return await self._open_read_only(ino, flags, session)
        result = await self._mutate(
            "open", self.store.open, request=request, ino=ino, flags=flags, session=session
        )
        return await self._settle_open(result, flags, session)

    @rpc_method
    async def open_read_only(self, opens: list[list[int]], session: int) -> list[OpenResult | None]:
        """Read-only opens of many [ino, flags] in one call (None: no such
        inode), each with a handle of its own: what a client's overlapping
        opens send together (client/open_batch.py). Any other failure fails
        the call, and the handles taken for it are given back first."""
        if len(opens) > READDIR_MAX:
            raise FsError(errno.E2BIG, f"open_read_only: {len(opens)} opens, at most {READDIR_MAX}")
        out: list[OpenResult | None] = []
        try:
            for pair in opens:
                if len(pair) != 2 or opens_for_writing(pair[1]):
                    raise FsError(errno.EINVAL, f"open_read_only: not [ino, flags]: {pair}")
                try:
                    out.append(await self._open_read_only(pair[0], pair[1], session))
                except FsError as exc:
                    if exc.code != errno.ENOENT:
                        raise
                    out.append(None)
        except FsError:
            taken = [res["handle"] for res in out if res is not None]
            orphans = [i for h in taken if (i := self.store.release_read_only(h, session))]
            if orphans:
                await self._mutate("open_read_only", self.store.free_orphans, inos=orphans)
            raise
        return out

    async def _open_read_only(self, ino: int, flags: int, session: int) -> OpenResult:
        """No write transaction: a read snapshot and an in-memory handle.
        If a free of the inode is being committed, wait for the writer's
        current transaction and look again (gone, or alive if it aborted)."""
        while True:
            try:
                return self.store.open_read_only(ino, flags, session)
            except FreeInProgress:
                await self.write(lambda: None)
            except FsError as exc:
                log.debug("open failed ino=%d flags=%#o: %s", ino, flags, exc.message)
                raise

    @rpc_method
    async def release(
        self, ino: int, handle: int, session: int, request: list[int] | None = None
    ) -> None:
        if is_read_only_handle(handle):
            orphan = self.store.release_read_only(handle, session)
            freed = orphan is not None and await self._mutate(
                "release", self.store.free_orphan, request=request, ino=orphan
            )
        else:
            freed = await self._mutate(
                "release",
                self.store.release,
                request=request,
                ino=ino,
                handle=handle,
                session=session,
            )
        if freed:
            log.debug("last handle closed ino=%d: freed", ino)
            self.jobs.wake()

    @rpc_method
    async def release_read_only(
        self, handles: list[list[int]], session: int, request: list[int] | None = None
    ) -> None:
        """Give many read-only handles back in one call: what a client's open
        cache expires together (client/open_cache.py), one round trip instead
        of a `release` each. Every handle is given back even if one fails
        (EBADF: another session's); the first failure is raised after."""
        orphans: list[int] = []
        failure: FsError | None = None
        for pair in handles:
            try:
                if len(pair) != 2 or not is_read_only_handle(pair[1]):
                    raise FsError(errno.EINVAL, f"not an [ino, read-only handle]: {pair[:2]}")
                orphan = self.store.release_read_only(pair[1], session)
            except FsError as exc:
                failure = failure or exc
                continue
            if orphan is not None:
                orphans.append(orphan)
        if orphans:
            freed = await self._mutate(
                "release_read_only", self.store.free_orphans, request=request, inos=orphans
            )
            if freed:
                log.debug("last handles closed: freed %d inodes", freed)
                self.jobs.wake()
        if failure is not None:
            raise failure

    @rpc_method
    async def unlink(self, parent: int, name: bytes, request: list[int] | None = None) -> None:
        if await self._mutate(
            "unlink", self.store.unlink, request=request, parent=parent, name=name
        ):
            self.jobs.wake()

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
    async def readdir(self, ino: int, after: bytes | None = None, limit: int = 256) -> ReaddirPage:
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
