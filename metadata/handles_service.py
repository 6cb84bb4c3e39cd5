"""The metadata server's sessions and file handles: opening a session,
renewing it (with the read-only handles it holds, which live in memory
only: `readonly.py`), closing it; opening files (a read-only open makes no
write transaction) and giving handles back, one or many at a time."""

from __future__ import annotations

import errno
import logging
import os
import stat

import trio

from shufflefs.metadata.files import opens_for_writing
from shufflefs.metadata.listing_rows import WatchedDirRowsPage
from shufflefs.metadata.protocol import (
    READDIR_MAX,
    CacheWatchReply,
    ClosedFile,
    MountInfo,
    OpenResult,
    Session,
    SessionInfo,
    WatchedDirPage,
    WrittenClose,
    is_read_only_handle,
)
from shufflefs.metadata.readonly import FreeInProgress
from shufflefs.metadata.service_base import ServiceBase
from shufflefs.metadata.sessions import live_session
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.schema import rpc_method

log = logging.getLogger("shufflefs.metadata.server")


class SessionsAndHandles(ServiceBase):
    """Sessions and file handles (the rest of `MetaService`)."""

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
        self.cache_watches.forget(session)
        if freed:
            self.jobs.wake()

    @rpc_method
    async def cache_watch(self, session: int, token: int, acked: int) -> CacheWatchReply:
        """A read-write mount's long poll for changes of the files it caches
        (cache_watch.py). Only the primary answers: a deposed one must not
        let clients trust a cache it no longer keeps fresh."""
        if self.role is not None:
            self.role.check_writable()
        if session not in self.cache_watches.watchers:  # a watcher only for a live session
            self.store.txns.read(lambda tx: live_session(tx, session, self.store.clock()))
        reply = await self.cache_watches.watch(session, token, acked)
        if self.role is not None:
            self.role.check_writable()
        return reply

    @rpc_method(inline=True)
    async def watch_dir(
        self, session: int, ino: int, limit: int = 256, names: bool = False, rows: bool = False
    ) -> WatchedDirPage | WatchedDirRowsPage:
        """A read-write mount's first page of a listing, and its watch of the
        directory (cache_watch.py): the kernel may keep the listing until
        the watch tells the mount of a change. The watch runs from the
        change counter of the attributes read here, so a change committed
        between them and the page is told (the client then does not trust
        the page). Primary only, as the long poll. Inline, as `readdir`:
        it waits for nothing (a task of its own cost every directory of a
        read-write mount's walk a trip through the scheduler)."""
        if self.role is not None:
            self.role.check_writable()
        if session not in self.cache_watches.watchers:  # only for a live session
            self.store.txns.read(lambda tx: live_session(tx, session, self.store.clock()))
        attr = self.store.getattr(ino)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, f"inode {ino} is not a directory")
        # with the attributes just read (no checkpoint between): a change
        # past them, committed from here on, is told
        since = self.cache_watches.watch_dir(session, ino, attr["change"], names)
        try:
            if rows:
                page = self.store.readdir_rows(ino, None, limit)
                return {**page, "attr": attr, "since": since}
            listed = self.store.readdir(ino, None, limit)
            return {**listed, "attr": attr, "since": since}
        except FsError:
            self.cache_watches.unwatch_dir(session, ino)
            raise

    # ---- file handles ---------------------------------------------------------

    @rpc_method(fast="open_now")
    async def open(
        self, ino: int, flags: int, session: int, request: list[int] | None = None
    ) -> OpenResult:
        if not opens_for_writing(flags):
            return await self._open_read_only(ino, flags, session)
        result = await self._mutate(
            "open", self.store.open, request=request, ino=ino, flags=flags, session=session
        )
        return await self._settle_open(result, flags, session)

    def open_now(
        self, ino: int, flags: int, session: int, request: list[int] | None = None
    ) -> OpenResult | None:
        """`open`'s read-only opens, inline (a task of their own cost each a
        trip through the scheduler): None for one that writes or must wait
        (a free of the inode being committed)."""
        if opens_for_writing(flags):
            return None
        return self._open_read_only_now(ino, flags, session)

    def lookup_open_now(self, parent: int, name: bytes, session: int) -> OpenResult | None:
        """`lookup_open`, inline; None if it must wait (as `open_now`)."""
        attr = self.store.lookup(parent, name)
        if not stat.S_ISREG(attr["mode"]):
            return {"attr": attr, "layout": None, "handle": 0}
        return self._open_read_only_now(attr["ino"], os.O_RDONLY, session)

    def _open_read_only_now(self, ino: int, flags: int, session: int) -> OpenResult | None:
        try:
            return self.store.open_read_only(ino, flags, session)
        except FreeInProgress:
            return None
        except FsError as exc:
            log.debug("open failed ino=%d flags=%#o: %s", ino, flags, exc.message)
            raise

    @rpc_method(fast="lookup_open_now")
    async def lookup_open(self, parent: int, name: bytes, session: int) -> OpenResult:
        """A lookup and, for a regular file, a read-only open (no write
        transaction either): one round trip for a read-only mount's cold
        sample instead of two. A file removed between the two is ENOENT, as
        if the lookup had come after."""
        attr = self.store.lookup(parent, name)
        if not stat.S_ISREG(attr["mode"]):
            return {"attr": attr, "layout": None, "handle": 0}
        return await self._open_read_only(attr["ino"], os.O_RDONLY, session)

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
    async def close_files(
        self, files: list[WrittenClose], session: int, request: list[int] | None = None
    ) -> list[ClosedFile]:
        """Many written files' closes in one call and one group commit
        (what a client's overlapping closes send together,
        client/length_reports.py): per file its length report, if asked,
        then its handle given back; each answered on its own."""
        if len(files) > READDIR_MAX:
            raise FsError(errno.E2BIG, f"close_files: {len(files)} files, at most {READDIR_MAX}")
        outcome = await self._mutate(
            "close_files", self.store.close_files, request=request, files=files, session=session
        )
        if outcome["freed"]:
            log.debug("close_files freed unlinked files")
            self.jobs.wake()
        return outcome["closed"]

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
