"""Read-only opens answered from this client's cache.

A read-only open costs the metadata server no write (an in-memory handle,
metadata/readonly.py), but a round trip for the open and another for the
release, per sample, is most of what an ordinary dataloader over small files
waits for. So this client keeps, per inode, the read-only handle, layout and
attributes of its last read-only open for `linger` seconds after the last
close, and the next read-only open reuses them:

* ``revalidate`` (the read-write mount): one read-only ``getattr``; if the
  inode's change counter (raised by every committed change of the inode,
  its writers' length reports included) is what it was and the file still
  has a name, the cached handle and layout are used: close-to-open holds,
  since whatever another client closed before this open raised the counter.
  Else the handle is given back and the file opened afresh.
* with a cache watch (the read-write mount, client/cache_watch.py): no
  round trip either, while the watch's lease runs: the metadata server tells
  this client of every change to a file it caches before the change is
  acknowledged to its writer, so an entry it has not dropped is current.
* ``trust`` (the ``-o ro`` dataset mount): no round trip at all. Attributes
  the kernel asks for anyway (after ``attr_timeout``) are compared on the
  way through (`observe`): a changed counter drops the entry, so a change
  made elsewhere reaches the next open within ``attr_timeout``.

The cached handle is a real handle: a file removed elsewhere keeps its data
while this client holds it, that is while it is open here and for at most
`linger` seconds after (or until `limit` other files push it out); the
session renewal reports cached handles with the open ones (a restarted
metadata server learns them back).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from shufflefs.cluster.metrics_catalog import OPEN_CACHE
from shufflefs.metadata.protocol import Attr, Layout, OpenResult
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.client.cache_watch import CacheWatch

log = logging.getLogger("shufflefs.client.open_cache")

TRUSTED, REVALIDATED, OPENED = (OPEN_CACHE.labels(r) for r in ("trusted", "revalidated", "opened"))
DEFAULT_LIMIT = 65536  # cached handles per client (the server holds each in memory)


@dataclass
class CachedOpen:
    ino: int
    handle: int  # a read-only handle on the metadata server
    layout: Layout | None
    attr: Attr  # as of the open or the last revalidation
    users: int = 0  # open files of this client using the handle now
    idle_since: float = 0.0  # trio time of the last close
    dropped: bool = False  # superseded or expired: give the handle back at the last close
    stamp: int = -1  # the cache watch's when the open was sent (-1: not trusted by it)
    used: bool = False  # an open used it (an `adopt`ed one is fresh until then)


class OpenCache:
    def __init__(
        self,
        getattr: Callable[[int], Awaitable[Attr]],
        open_fresh: Callable[[int, int], Awaitable[OpenResult]],
        release: Callable[[int, int], Awaitable[None]],
        *,
        release_many: Callable[[list[tuple[int, int]]], Awaitable[None]] | None = None,
        open_many: Callable[[list[int]], Awaitable[list[OpenResult | None]]] | None = None,
        trust: bool,
        linger: float,
        limit: int = DEFAULT_LIMIT,
        watch: CacheWatch | None = None,
    ) -> None:
        self._getattr = getattr
        self._open = open_fresh
        self._release = release  # (ino, handle): give a read-only handle back
        self._release_many = release_many  # [(ino, handle)]: the same, one round trip
        self._open_many = open_many  # [ino]: read-only opens in one round trip (None: gone)
        self.trust = trust
        self.watch = watch  # set by the owner: cached opens it trusts skip revalidation
        # an inode left the cache: (ino, whether what others were told of it must go)
        self.on_forget: Callable[[int, bool], None] | None = None
        self.linger = linger
        self.limit = limit
        self.entries: dict[int, CachedOpen] = {}
        # the entries nobody uses, oldest close first (`expire` looks at the
        # front only: sorting every entry each round was 7% of a mount's CPU
        # under a prefetched epoch)
        self._idle: dict[int, CachedOpen] = {}
        self._unused: list[CachedOpen] = []  # dropped by `observe`, to give back
        self._giving_back: dict[int, trio.Event] = {}  # ino -> set once `expire` gave it back
        self.hits = 0  # opens answered from the cache (revalidated or trusted)
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.linger > 0

    async def open(self, ino: int, flags: int) -> tuple[CachedOpen, bool]:
        """A read-only open of *ino*: (the entry now in use, whether an
        earlier open used it: if not, what the client cached of the file
        must be read afresh)."""
        hit = self.open_now(ino)
        if hit is not None:
            return hit
        entry = self.entries.get(ino)
        how = TRUSTED  # (an entry of a file with no name left: `open_now` leaves it here)
        if entry is not None and not self.trust and not self._watched(entry):
            how = REVALIDATED
            attr = await self._getattr(ino)
            if attr["change"] == entry.attr["change"] and attr["nlink"] > 0:
                entry.attr = attr
            else:
                await self._drop(entry)
                entry = None
        if entry is not None and self.entries.get(ino) is entry:
            return self._use(entry, how)
        stamp = self.stamp()
        res = await self._open(ino, flags)
        self.misses += 1
        OPENED.inc()
        fresh = CachedOpen(
            ino, res["handle"], res["layout"], res["attr"], users=1, stamp=stamp, used=True
        )
        old = self.entries.get(ino)
        if old is not None:  # another open raced ours: the newer one stays
            await self._drop(old)
        self.entries[ino] = fresh
        return fresh, False

    def open_now(self, ino: int) -> tuple[CachedOpen, bool] | None:
        """`open` when it needs no round trip (the entry is trusted, or kept
        fresh by the cache watch), else None and nothing done. An entry of
        a file with no name left is not taken here: its open fails ESTALE
        (fuse/ops.py), which takes the asynchronous path."""
        entry = self.entries.get(ino)
        if entry is None or entry.attr["nlink"] == 0:
            return None
        if not self.trust and not self._watched(entry):
            return None
        return self._use(entry, TRUSTED)

    def _use(self, entry: CachedOpen, how: Any) -> tuple[CachedOpen, bool]:
        """*entry* taken by an open (*how*: the counter of the way it was answered)."""
        self.hits += 1
        how.inc()
        entry.users += 1
        self._idle.pop(entry.ino, None)
        # an entry made ahead of its open (`adopt`) is a fresh open at its first use
        before, entry.used = entry.used, True
        return entry, before

    async def open_ahead(self, inos: list[int]) -> dict[int, CachedOpen]:
        """Handles for opens expected soon (the prefetcher's, fuse/prefetch.py,
        before it reads hinted files): what the cache holds is taken as it
        is (a stale one is caught by the reader's own open, which
        revalidates unless `trust`), the rest are opened in one call and kept
        as idle entries, so the reader's open reuses them and they are given
        back after `linger` like any other. An inode gone is left out, and so
        is one with no name left (removed since the caller listed it, kept
        alive by a handle somewhere): its handle is given back by the next
        `expire` instead of keeping its space for `linger`."""
        out = {ino: e for ino in inos if (e := self.entries.get(ino)) is not None}
        wanted = [ino for ino in dict.fromkeys(inos) if ino not in out]
        if not wanted:
            return out
        assert self._open_many is not None and self.enabled
        stamp = self.stamp()
        for res in await self._open_many(wanted):
            if res is not None:
                entry = self.adopt(res, stamp)
                if not entry.dropped:
                    out[res["attr"]["ino"]] = entry
        return out

    def adopt(self, res: OpenResult, stamp: int = -1) -> CachedOpen:
        """A read-only open made for an open to come (`open_ahead`, a
        read-only mount's `lookup_open`): kept as an idle entry, unless the
        cache holds the inode already (then it is given back by the next
        `expire`, and the held entry returned). A file with no name left is
        not kept either (no open by name can reach it, `open_now`; kept, its
        handle would hold the file's space for `linger`): the entry returned
        is marked dropped and given back by the next `expire`."""
        ino = res["attr"]["ino"]
        entry = CachedOpen(ino, res["handle"], res["layout"], res["attr"], stamp=stamp)
        entry.idle_since = trio.current_time()
        if res["attr"]["nlink"] == 0:
            self._retire(entry)
            return entry
        held = self.entries.get(ino)
        if held is not None:  # an open raced ours: its entry stays, ours goes back
            self._retire(entry)
            return held
        self.entries[ino] = entry
        self._idle[ino] = entry
        return entry

    async def discard(self, ino: int) -> None:
        """Out of the cache, its handle given back once unused; also a handle
        `observe` already dropped but `expire` has not given back yet (an
        open for writing must not find the inode kept alive by it)."""
        entry = self.entries.get(ino)
        if entry is not None:
            await self._drop(entry)
        waiting = [e for e in self._unused if e.ino == ino]
        if waiting:
            self._unused = [e for e in self._unused if e.ino != ino]
            for e in waiting:
                await self._release(e.ino, e.handle)
        returned = self._giving_back.get(ino)
        if returned is not None:  # `expire` is giving it back right now
            await returned.wait()

    async def close(self, entry: CachedOpen) -> None:
        """An open file using *entry* was closed: no round trip unless the
        entry was dropped meanwhile and this was its last user."""
        if self.close_now(entry):
            await self._release(entry.ino, entry.handle)

    def close_now(self, entry: CachedOpen) -> bool:
        """`close` but for the round trip: whether the caller must give the
        handle back (the entry was dropped and this was its last user)."""
        entry.users -= 1
        entry.idle_since = trio.current_time()
        if entry.users <= 0 and self.entries.get(entry.ino) is entry:
            self._idle.pop(entry.ino, None)
            self._idle[entry.ino] = entry  # the newest idle one
        return entry.users <= 0 and entry.dropped

    def observe(self, attr: Attr) -> None:
        """Attributes fetched for any reason: a changed counter drops the
        entry (its handle is given back by the next `expire`)."""
        entry = self.entries.get(attr["ino"])
        if entry is not None and attr["change"] != entry.attr["change"]:
            self._retire(entry)

    def changed(self, ino: int, change: int) -> None:
        """The cache watch says another client changed *ino* (its counter is
        *change* now): an older entry is dropped (given back by `expire`)."""
        entry = self.entries.get(ino)
        if entry is not None and entry.attr["change"] < change:
            self._retire(entry)

    def drop_all(self) -> None:
        """A new cache watcher: every entry goes (given back by `expire`, or
        by its last close)."""
        for entry in list(self.entries.values()):
            self._retire(entry)

    def handles(self) -> list[tuple[int, int]]:
        """(ino, handle) of every cached handle (for the session renewal)."""
        held = [*self.entries.values(), *self._unused]
        return [(e.ino, e.handle) for e in held]

    def clear(self) -> None:
        """The session was lost: its handles are gone on the server."""
        for entry in self.entries.values():
            entry.dropped = True
            if self.on_forget is not None:
                self.on_forget(entry.ino, True)
        self.entries.clear()
        self._idle.clear()
        self._unused.clear()

    async def expire(self) -> int:
        """Give back the handles idle for longer than `linger`, and the
        oldest idle ones beyond `limit`. Returns how many were given back."""
        now = trio.current_time()
        over = max(0, len(self.entries) - self.limit)
        expired: list[CachedOpen] = []
        for e in self._idle.values():
            if len(expired) >= over and now - e.idle_since < self.linger:
                break
            expired.append(e)
        unused, self._unused = self._unused, []
        # (what the kernel was told of them expired before they did: `trusted_for`)
        back = [e for e in expired if self._forget(e, tell=False)] + unused
        done = trio.Event()
        for entry in back:
            self._giving_back[entry.ino] = done
        try:
            if self._release_many is not None and back:
                # one round trip for them all: an epoch longer than `linger`
                # expires a handle per sample, which would otherwise cost the
                # metadata server (and this client) a `release` call each
                await self._release_many([(e.ino, e.handle) for e in back])
            else:
                for entry in back:
                    await self._release(entry.ino, entry.handle)
        finally:
            for entry in back:
                if self._giving_back.get(entry.ino) is done:
                    del self._giving_back[entry.ino]
            done.set()
        return len(expired) + len(unused)

    async def run(self) -> None:
        """Expire idle handles until cancelled."""
        while True:
            await trio.sleep(max(0.05, min(self.linger / 2, 1.0)))
            try:
                await self.expire()
            except FsError as exc:  # the session's end gives it back in any case
                log.warning("giving back cached read-only handles: %s", exc.message)

    # ---- internals -----------------------------------------------------------------

    def stamp(self) -> int:
        """For an open about to be sent whose handle may be `adopt`ed."""
        return -1 if self.watch is None else self.watch.stamp()

    def trusted_for(self, ino: int) -> float:
        """Seconds the cache watch keeps *ino*'s cached open fresh from now
        (0: not cached, or not trusted), and it stays cached: within the
        watch's lease and, if idle, its linger."""
        entry = self.entries.get(ino)
        if entry is None or self.watch is None or not self._watched(entry):
            return 0.0
        now = trio.current_time()
        left = self.watch.trusted_until - now
        if entry.users <= 0:  # no longer than it may stay idle: `expire` tells no one
            left = min(left, entry.idle_since + self.linger - now)
        return left

    def _watched(self, entry: CachedOpen) -> bool:
        """Kept fresh by the cache watch: no need to ask."""
        watch = self.watch
        return watch is not None and watch.trusts(entry.ino, entry.attr["change"], entry.stamp)

    def _forget(self, entry: CachedOpen, tell: bool = True) -> bool:
        """Out of the cache; returns whether nobody uses its handle (the
        caller gives it back), else the last close does. *tell*: what
        `on_forget` told others of it must be taken back (not for an entry
        that lingered out: that expired with it)."""
        if self.entries.get(entry.ino) is entry:
            del self.entries[entry.ino]
            self._idle.pop(entry.ino, None)
            if self.on_forget is not None:
                self.on_forget(entry.ino, tell)
        entry.dropped = True
        return entry.users <= 0

    def _retire(self, entry: CachedOpen) -> None:
        """Out of the cache, its handle given back by the next `expire` (or
        by its last close)."""
        if self._forget(entry):
            self._unused.append(entry)

    async def _drop(self, entry: CachedOpen) -> None:
        if self._forget(entry):
            await self._release(entry.ino, entry.handle)
