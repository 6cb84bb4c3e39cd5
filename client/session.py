"""The metadata session of one client: opened at start, renewed in the
background, and replaced if it expired while we could not reach the metadata
server. Every open file holds a handle under it, so an unlinked file keeps its
data until this client closes it (or the session expires). Read-only handles
are held in the metadata server's memory only, so each renewal reports them
(after a server restart that is how it learns them back).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from shufflefs.client.meta_client import MetaClient
from shufflefs.metadata.protocol import SESSION_EXPIRED, MountInfo
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.addresses import hostname
from shufflefs.rpc.errors import FsError

T = TypeVar("T")

log = logging.getLogger("shufflefs.client.session")

PRIMARY_CHECK = 0.5  # seconds between looks at who the metadata primary is


class Session:
    def __init__(
        self,
        meta: MetaClient,
        name: str,
        reopen: Callable[[], Awaitable[None]],
        open_ro: Callable[[], list[list[int]]] = list,
        mount: MountInfo | None = None,
    ) -> None:
        self.meta = meta
        self.name = name
        self.id = 0  # 0: not open
        self._reopen = reopen  # takes new handles for the open files under a new session
        # [ino, handle] of our read-only handles, sent with every renewal: the
        # server holds them in memory only and learns them back after a restart
        self._open_ro = open_ro
        self._lock = trio.Lock()
        self.mount = mount  # a FUSE mount's report of itself (`shufflefs status` lists it)

    async def start(self, nursery: trio.Nursery) -> None:
        lease = await self._open()
        nursery.start_soon(self._keep, lease)

    async def _open(self) -> float:
        s = await self.meta.call_at_most_once(
            "session_open", lambda m: m.session_open(self.name, hostname(), os.getpid(), self.mount)
        )
        self.id = s["session"]
        log.info("metadata session %d opened (lease %.0fs)", self.id, s["lease"])
        return s["lease"]

    def _primary(self) -> str | None:
        try:
            return self.meta.routing.current.meta_address()
        except FsError:
            return None

    async def _keep(self, lease: float) -> None:
        """Renew every third of the lease, and at once when the metadata
        primary changed: a promoted server knows no read-only handle and
        frees no unlinked inode until every session has reported its handles
        (its restart grace), so the sooner we report, the sooner it frees."""
        interval = max(0.5, lease / 3)
        renewed_with = self._primary()
        due = trio.current_time() + interval
        while True:
            await trio.sleep(max(0.0, min(PRIMARY_CHECK, due - trio.current_time())))
            primary = self._primary()
            if trio.current_time() < due and primary == renewed_with:
                continue
            renewed_with, due = primary, trio.current_time() + interval
            session = self.id
            held = self._open_ro()
            try:
                await self.meta.call_idempotent(
                    "session_renew",
                    lambda m: m.session_renew(session, held),  # noqa: B023 (awaited right here)
                )
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    log.warning("session %d renewal failed: %s", session, exc.message)
                    continue
                await self.recover(session)

    async def recover(self, lost: int) -> None:
        """The metadata server no longer holds session *lost* (it expired
        while we could not reach it): open a new one and take new handles for
        our open files. Several callers may notice at once; one recovers."""
        async with self._lock:
            if self.id != lost:
                return
            log.warning("session %d expired; opening a new one", lost)
            await self._open()
            await self._reopen()

    async def call(self, what: str, call: Callable[[MetaStub, int], Awaitable[T]]) -> T:
        """An open/create under our session, renewing a lost session once."""
        session = self.id
        try:
            return await self.meta.call_at_most_once(what, lambda m: call(m, session))
        except FsError as exc:
            if exc.code != SESSION_EXPIRED:
                raise
        await self.recover(session)
        return await self.meta.call_at_most_once(what, lambda m: call(m, self.id))

    async def close(self) -> None:
        if self.id:
            try:
                await self.meta.call_at_most_once(
                    "session_close", lambda m: m.session_close(self.id)
                )
            except FsError as exc:
                log.warning("closing session %d: %s", self.id, exc.message)
            self.id = 0
