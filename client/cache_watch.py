"""The client's side of a cache watch (metadata/cache_watch.py): the lease
under which a read-write mount trusts its cached opens without asking the
metadata server on every open.

`run` keeps one `cache_watch` long poll outstanding. Each reply names the
cached files another client changed (they are dropped from the open cache
before the next request acknowledges them) and extends the lease to
`lease` seconds after that request was sent. A cached open is trusted
(`trusts`) while the lease runs, if it was made under the current watcher
(`stamp`, taken when its open was sent) and no reply has named a newer
change of its file. Anything else (no watch yet, the server unreachable
for a lease, a new watcher token after a server restart or promotion) falls
back to revalidating each open, as without a watch.

The watch keeps directory listings too (`watched_dir`, after the server's
`watch_dir` gave the first page): while `dir_attr` answers, the listing the
kernel holds of the directory (``FOPEN_CACHE_DIR``) and the directory's
attributes are current. A change of it named by a reply ends that, once
(`dir_changed` is told, to drop the kernel's listing): the next listing
watches it again.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.session import Session
from shufflefs.metadata.protocol import Attr, CacheWatchReply, WatchedDirPage
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.client.cache_watch")

RETRY = 0.5  # seconds between tries while the metadata server cannot be reached
RECENT = 120.0  # seconds a change named by a reply is remembered (for opens in flight)


class CacheWatch:
    def __init__(
        self,
        meta: MetaClient,
        session: Session,
        changed: Callable[[int, int], None],
        distrust: Callable[[], None],
    ) -> None:
        self.meta = meta
        self.session = session
        self._changed = changed  # (ino, change): another client changed a cached file
        self._distrust = distrust  # a new watcher: drop every cached open
        self.token = 0
        self.generation = 0  # raised with every new token: older stamps are not trusted
        self.acked = 0
        self.trusted_until = float("-inf")  # this client's trio clock
        # {ino: (change, when)}: an open sent before a reply named the change
        # may come back after it, with the attributes from before
        self._recent: dict[int, tuple[int, float]] = {}
        # {directory ino: (its attributes, stamp)}: listings this watch keeps fresh
        self.dirs: dict[int, tuple[Attr, int]] = {}
        self.dir_changed: Callable[[int], None] | None = None  # told when one is dropped
        self.dirs_supported = True  # the server has `watch_dir`
        self.replies = 0
        self._scope = trio.CancelScope()

    def stamp(self) -> int:
        """Taken when an open is sent: its entry is trusted only under the
        watcher current then."""
        return self.generation

    def trusts(self, ino: int, change: int, stamp: int) -> bool:
        """May a cached open of *ino* at counter *change*, stamped *stamp*,
        be used without asking the metadata server?"""
        if stamp != self.generation or trio.current_time() >= self.trusted_until:
            return False
        recent = self._recent.get(ino)
        return recent is None or change >= recent[0]

    async def watch_dir(self, ino: int, limit: int) -> WatchedDirPage | None:
        """The first page of directory *ino*'s listing, which the watch keeps
        fresh from here if it can (`dir_attr`); None: list it as usual (the
        server cannot watch it; any error is the plain listing's to give)."""
        if not self.dirs_supported or trio.current_time() >= self.trusted_until:
            return None
        stamp, session = self.generation, self.session.id
        try:
            page = await self.meta.call_idempotent(
                "watch_dir", lambda m: m.watch_dir(session, ino, limit)
            )
        except FsError as exc:
            if exc.code == errno.ENOSYS:
                log.info("the metadata server cannot watch directories: listings are not kept")
                self.dirs_supported = False
            return None
        attr = page["attr"]
        if page["since"] == attr["change"] and self.trusts(ino, attr["change"], stamp):
            self.dirs[ino] = (attr, stamp)
        return page

    def dir_attr(self, ino: int) -> Attr | None:
        """The attributes of a directory whose listing the watch keeps fresh
        (and so may the kernel's), or None: list it afresh."""
        watched = self.dirs.get(ino)
        if watched is None:
            return None
        attr, stamp = watched
        if not self.trusts(ino, attr["change"], stamp):
            del self.dirs[ino]
            return None
        return attr

    async def start(self, nursery: trio.Nursery) -> None:
        """The first reply (answered at once: a new watcher), then the long
        poll in the background: opens made from now on can be trusted."""
        try:
            await self._poll()
        except FsError as exc:
            if exc.code == errno.ENOSYS:
                log.info("the metadata server has no cache watch: every open revalidates")
                return
            log.warning("cache watch unavailable for now (opens revalidate): %s", exc.message)
        nursery.start_soon(self.run)

    async def run(self) -> None:
        """Keep the long poll going until cancelled or `stop`ped."""
        with self._scope:
            while True:
                try:
                    await self._poll()
                except FsError as exc:
                    log.debug("cache watch: %s", exc.message)
                    await trio.sleep(RETRY)

    def stop(self) -> None:
        """No more polls (the session is closing): nothing is trusted after."""
        self._scope.cancel()
        self.trusted_until = float("-inf")
        self.dirs.clear()

    async def _poll(self) -> None:
        session = self.session.id
        sent = trio.current_time()
        reply = await self.meta.call_idempotent(
            "cache_watch", lambda m: m.cache_watch(session, self.token, self.acked)
        )
        if session == self.session.id:  # else a new session: a new watcher next time
            self._apply(reply, sent)

    def _apply(self, reply: CacheWatchReply, sent: float) -> None:
        if reply["token"] != self.token:
            if self.token:
                log.info("cache watch: a new watcher; cached opens are dropped")
                self._distrust()
            self.dirs.clear()
            self.token = reply["token"]
            self.generation += 1
        now = trio.current_time()
        for ino, change in reply["changed"]:
            self._recent[ino] = (change, now)
            self._changed(ino, change)
            if self.dirs.pop(ino, None) is not None and self.dir_changed is not None:
                self.dir_changed(ino)
        if len(self._recent) > 4096 or self.replies % 64 == 0:
            self._recent = {i: r for i, r in self._recent.items() if now - r[1] < RECENT}
        self.acked = reply["seq"]
        self.trusted_until = sent + reply["lease"]
        self.replies += 1
