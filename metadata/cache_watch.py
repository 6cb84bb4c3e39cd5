"""Cache watches: a read-write mount's cached opens kept fresh by the
metadata server instead of a revalidation per open.

A read-write mount is close-to-open: an open that starts after a writer's
close must see what the writer wrote. Without help that costs every open of
a cached file a `getattr` round trip (client/open_cache.py). With a watch,
the client holds a *lease* on its cached read-only opens instead, in the
manner of AFS callbacks and NFSv4 read delegations:

* The client keeps one `cache_watch` request outstanding (a long poll).
  The server answers it at once when it has changes for the client, else
  after `POLL` seconds; the client sends the next one as soon as the reply
  is applied. Each request carries the last change sequence number the
  client has applied (`acked`), which is the acknowledgement.
* A reply lets the client trust its cached opens until `lease` seconds
  after it *sent* the request (its own clock), so long as nothing in the
  reply says otherwise.
* When a committed mutation changes a regular file (its change counter
  rose: a writer's length report, a truncate, a chmod, an unlink), every
  session holding a read-only handle on the file (readonly.py: that is what
  a client's cached open is) is told `[ino, change]` in its next reply;
  when it changes a directory (a name added, removed or renamed in it; its
  own attributes), every session that watches the directory's listing
  (`watch_dir`: the client lists it and lets the kernel cache the listing)
  is told the same way, once: the client lists it again to watch it again;
  but not the session that alone made the change by a create, if its
  client said it keeps names (`watch_dir(..., names=True)`): its reply
  tells it; its watch goes on from that change (the client keeps the
  directory's names, and answers the LOOKUP before each create itself).
  The mutation is acknowledged only once each such client has acknowledged
  the change, or its lease from the last reply without the change has ended
  (the server's clock, from when that request arrived: never before the
  client's own deadline). So an open that starts after the writer's close
  either finds the cache entry dropped or revalidates, and an opendir
  lists afresh: close-to-open holds, for names too.
* A client that stops answering (stopped, partitioned) costs the writers of
  the files it caches at most `lease` + `MARGIN` seconds, once.
* Every watcher has a token; a reply with a token the client has not seen
  (a new watcher after the old one was dropped, a restarted or newly
  promoted server) makes the client distrust every cached open it holds
  (they revalidate until they linger out; opens made from then on are
  trusted again). A server that starts or is promoted does not know what
  an earlier server's watchers trust, so for its first `lease` + `MARGIN`
  seconds, mutations of files that a session from before it may cache (and
  of anything, directories included, while such a session lives) wait
  out that time (`grace_until`; a fresh cluster has no such session).

The other side is client/cache_watch.py; docs/metadata.md, "Cache watches",
is the protocol's description.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from shufflefs.cluster.metrics_catalog import CACHE_WATCH_WAIT_SECONDS, CACHE_WATCH_WAITS
from shufflefs.metadata.protocol import CacheWatchReply

log = logging.getLogger("shufflefs.metadata.cache_watch")

LEASE = 3.0  # seconds a reply lets a client trust its cached opens, from its request
POLL = 1.0  # a request with nothing to tell is answered after this
MARGIN = 0.5  # seconds a writer waits beyond a silent client's lease
FORGET = 60.0  # seconds after its lease a silent client's watcher is dropped
MAX_CHANGES = 4096  # [ino, change] pairs per reply at most (the rest follow at once)
MAX_DIRS = 1 << 16  # directories one session may watch at a time (beyond: not watched)


@dataclass(eq=False)
class _Watcher:
    token: int
    seq: int = 0  # sequence number of the last change queued
    acked: int = 0  # the client has applied every change up to here
    trust_end: float = float("-inf")  # server time: the client trusts no longer than this
    queued: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, ino, change)
    wake: trio.Event = field(default_factory=trio.Event)  # a change for the waiting request
    moved: trio.Event = field(default_factory=trio.Event)  # acked moved on


class CacheWatches:
    """Every session's watcher; `changed` is what the writer awaits after a
    commit, `watch` the body of the `cache_watch` call."""

    def __init__(
        self,
        readers: Callable[[int], Iterable[int]],
        may_be_unknown: Callable[[], bool],
        earlier: Callable[[int], bool],
        any_earlier: Callable[[], bool],
        *,
        lease: float = LEASE,
        poll: float = POLL,
    ) -> None:
        self._readers = readers  # sessions holding a read-only handle on an inode
        # whether some session's handles are not known here yet (a restart's grace)
        self._may_be_unknown = may_be_unknown
        # whether a session was live before this server began (its client
        # may still trust what an earlier server's watcher told it)
        self._earlier = earlier
        self._any_earlier = any_earlier  # whether any session is from before (its dirs unknown)
        self.lease = lease
        self.poll = poll
        self.watchers: dict[int, _Watcher] = {}
        # directory -> {session watching its listing: the change counter it read}
        self.dirs: dict[int, dict[int, int]] = {}
        self._dirs_of: dict[int, set[int]] = {}  # session -> the directories it watches
        # sessions whose clients keep a watched directory's names from their own
        # creates' replies (`watch_dir(..., names=True)`): not told of those
        self._own_creates: set[int] = set()
        self._tokens = itertools.count(random.randrange(1 << 40) << 20)
        self.grace_until = 0.0  # until `begin`
        self._pruned = float("-inf")

    def begin(self) -> None:
        """This server starts serving (or is promoted): what earlier servers'
        watchers trust is unknown for one lease."""
        self.grace_until = trio.current_time() + self.lease + MARGIN
        self.watchers.clear()
        self.dirs.clear()
        self._dirs_of.clear()
        self._own_creates.clear()

    def forget(self, session: int) -> None:
        """The session ended: its client trusts nothing any more once its
        lease ends (writers already waiting keep their deadline)."""
        self.watchers.pop(session, None)
        self._own_creates.discard(session)
        for ino in self._dirs_of.pop(session, ()):
            self._unwatch(ino, session)

    def watch_dir(self, session: int, ino: int, change: int, names: bool = False) -> int | None:
        """*session* read directory *ino* at change counter *change* and
        watches its listing: the next change past that is told to the
        session's watcher (once). Returns the counter the watch runs from:
        an older one when the session watched it already (a change past
        that one may be on its way to the client, which must then not trust
        this read); None: the session watches `MAX_DIRS` already. *names*:
        its client keeps directories' names from its own creates' replies,
        so the directory changes it alone makes by a create are not told
        to it (`changed`); a client of before that is told of every one."""
        if names:
            self._own_creates.add(session)
        mine = self._dirs_of.setdefault(session, set())
        if ino not in mine and len(mine) >= MAX_DIRS:
            return None
        mine.add(ino)
        watching = self.dirs.setdefault(ino, {})
        since = watching[session] = min(watching.get(session, change), change)
        return since

    def unwatch_dir(self, session: int, ino: int) -> None:
        mine = self._dirs_of.get(session)
        if mine is not None:
            mine.discard(ino)
        self._unwatch(ino, session)

    def _unwatch(self, ino: int, session: int) -> None:
        sessions = self.dirs.get(ino)
        if sessions is not None:
            sessions.pop(session, None)
            if not sessions:
                del self.dirs[ino]

    # ---- the client's side ------------------------------------------------------

    async def watch(self, session: int, token: int, acked: int) -> CacheWatchReply:
        """One long-poll request of *session*'s client."""
        arrived = trio.current_time()
        self._prune(arrived)
        w = self.watchers.get(session)
        if w is None:
            w = self.watchers[session] = _Watcher(next(self._tokens))
        if w.token != token:
            # a client new to this watcher trusts nothing it cached before:
            # answer at once, so it starts trusting from here
            return self._reply(w, arrived)
        if acked > w.acked:
            w.acked = min(acked, w.seq)
            w.queued = [q for q in w.queued if q[0] > w.acked]
            w.moved.set()
            w.moved = trio.Event()
        if not w.queued:
            w.wake = trio.Event()
            with trio.move_on_after(self.poll):
                await w.wake.wait()
        if self.watchers.get(session) is not w:  # forgotten meanwhile (session ended)
            w = self.watchers.setdefault(session, _Watcher(next(self._tokens)))
        return self._reply(w, arrived)

    def _reply(self, w: _Watcher, arrived: float) -> CacheWatchReply:
        # every change queued so far goes out with this reply, so the trust
        # it grants may start at its request's arrival
        w.trust_end = max(w.trust_end, arrived + self.lease)
        sent = w.queued[:MAX_CHANGES]
        return {
            "token": w.token,
            "seq": sent[-1][0] if sent else w.seq,
            "changed": [[ino, change] for _, ino, change in sent],
            "lease": self.lease,
        }

    # ---- the writer's side ----------------------------------------------------------

    async def changed(
        self,
        files: dict[int, int],
        dirs: dict[int, int] | None = None,
        by: dict[int, int | None] | None = None,
    ) -> None:
        """Regular files, and directories, whose change counters a commit
        raised ({ino: change}): tell every watching client that caches one
        (or watches its listing), and return once each has applied it or can
        no longer trust its cache. A directory only one session changed
        (*by*: a create names its session) is not told to that session: the
        reply tells it, and its watch of the directory goes on from there."""
        dirs = dirs or {}
        if not files and not dirs:
            return
        now = trio.current_time()
        waits: list[tuple[_Watcher | None, int, float]] = []
        for session, changes in self._by_session(files, dirs, by or {}).items():
            w = self.watchers.get(session)
            if w is None:
                if self._earlier(session):  # trusts at most what an earlier server gave it
                    waits.append((None, 0, self.grace_until))
                continue
            for ino, change in changes:
                w.seq += 1
                w.queued.append((w.seq, ino, change))
            w.wake.set()
            waits.append((w, w.seq, max(w.trust_end + MARGIN, self.grace_until)))
        if now < self.grace_until and (self._may_be_unknown() or (dirs and self._any_earlier())):
            # holders not all known yet; directories watched through an
            # earlier server are never re-reported
            waits.append((None, 0, self.grace_until))
        for w, seq, deadline in waits:
            with trio.move_on_at(deadline) as scope:
                while w is None or w.acked < seq:
                    await (trio.sleep_forever() if w is None else w.moved.wait())
            if w is None:
                result = "grace"
            elif scope.cancelled_caught:
                result = "lease"
                log.info(
                    "cache watch: no acknowledgement of change %d from a client within its "
                    "lease; going on (its lease has ended)",
                    seq,
                )
            else:
                result = "acked"
            CACHE_WATCH_WAITS.labels(result).inc()
        if waits:
            CACHE_WATCH_WAIT_SECONDS.observe(trio.current_time() - now)

    def _prune(self, now: float) -> None:
        """Drop the watchers silent for `FORGET` seconds (their clients
        trust nothing; one that comes back gets a new token)."""
        if now < self._pruned + FORGET:
            return
        self._pruned = now
        for session, w in list(self.watchers.items()):
            if w.trust_end + FORGET < now:
                del self.watchers[session]
                self._own_creates.discard(session)
                for ino in self._dirs_of.pop(session, ()):
                    self._unwatch(ino, session)

    def _by_session(
        self, files: dict[int, int], dirs: dict[int, int], by: dict[int, int | None]
    ) -> dict[int, list[tuple[int, int]]]:
        """{session: [(ino, change)…]}: whom to tell of what."""
        out: dict[int, list[tuple[int, int]]] = {}
        for ino, change in files.items():
            for session in self._readers(ino):
                out.setdefault(session, []).append((ino, change))
        for ino, change in dirs.items():
            watching = self.dirs.get(ino, {})
            for session, since in list(watching.items()):
                if since >= change:  # it read this change already
                    continue
                if by.get(ino) == session and session in self._own_creates:
                    # its own change alone: every change since it read the
                    # directory was its own (another's would have ended this
                    # watch), and its reply tells it of this one
                    watching[session] = change
                    continue
                del watching[session]  # once: listed again to watch again
                self._dirs_of.get(session, set()).discard(ino)
                out.setdefault(session, []).append((ino, change))
            if not watching:
                self.dirs.pop(ino, None)
        return out
