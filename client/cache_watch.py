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
watches it again. So does a change of it by this client other than a
create (`changing`; the kernel drops its own listing then).

And the names of a watched directory whose listing came whole in one page
(`names`): while the watch holds, a name not among them is absent, so the
kernel's LOOKUP of a name about to be created (``open(O_CREAT)``, ``tar x``,
``cp -r``) is answered with no round trip (`absent`). They are listed on
this client's first create in the directory (`learn_names`, at most once
per `RELEARN` seconds a directory). This client's own creates
keep them: the server does not tell a session's watch of a directory
change that session alone made by a create (metadata/cache_watch.py), and
the create's reply, which carries the directory's attributes after it,
adds the name (`created`) when those are the next change after the ones
held (else every change between is not known to be ours: dropped). Any
other change of the directory by this client drops them (`changing`),
as does any change by another, which the watch names before that change is
acknowledged. The kernel holds a directory's lock across a LOOKUP in it and
exclusively across a change of it, so the listing and this client's own
changes of one directory never overlap.
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.session import Session
from shufflefs.metadata.protocol import READDIR_MAX, Attr, CacheWatchReply, WatchedDirPage
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.client.cache_watch")

RETRY = 0.5  # seconds between tries while the metadata server cannot be reached
RECENT = 120.0  # seconds a change named by a reply is remembered (for opens in flight)
RELEARN = 5.0  # seconds before a directory's names are listed again (`learn_names`)
LARGE_DIR_WAIT = 60.0  # the same for one with more than one page (`READDIR_MAX`) of names
MAX_NAMES = 1 << 18  # names of watched directories held in all (the oldest directory's go first)
MAX_LISTED = 1 << 16  # directories whose last listing time is remembered


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
        # {directory ino: every name in it}, for directories in `dirs` listed whole
        self.names: OrderedDict[int, set[bytes]] = OrderedDict()
        self._names_held = 0
        self._next_listing: dict[int, float] = {}  # directory -> when `learn_names` may list it
        self.dirs_supported = True  # the server has `watch_dir`
        # ... and does not tell a watch of its own creates (`watch_dir(names=True)`)
        self.names_supported = True
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
            page = await self._watch_dir(session, ino, limit)
        except FsError as exc:
            if exc.code == errno.ENOSYS:
                log.info("the metadata server cannot watch directories: listings are not kept")
                self.dirs_supported = False
            return None
        attr = page["attr"]
        held = self.dirs.get(ino)
        if page["since"] != attr["change"] or not self.trusts(ino, attr["change"], stamp):
            self.forget_names((ino,))
            return page
        if not page["more"] and self.names_supported:
            self.forget_names((ino,))
            self._hold_names(ino, {name for name, _ in page["entries"]})
        elif held is None or held[0]["change"] != attr["change"]:
            self.forget_names((ino,))  # (the names held are of this state: they stay)
        self.dirs[ino] = (attr, stamp)
        return page

    async def _watch_dir(self, session: int, ino: int, limit: int) -> WatchedDirPage:
        names = self.names_supported
        try:
            return await self.meta.call_idempotent(
                "watch_dir", lambda m: m.watch_dir(session, ino, limit, names)
            )
        except FsError as exc:
            if not (names and exc.code == errno.EINVAL and "'names'" in exc.message):
                raise
        log.info("the metadata server tells a watch of its own creates: names are not kept")
        self.names_supported = False
        self.forget_names(None)
        return await self.meta.call_idempotent(
            "watch_dir", lambda m: m.watch_dir(session, ino, limit)
        )

    def dir_attr(self, ino: int) -> Attr | None:
        """The attributes of a directory whose listing the watch keeps fresh
        (and so may the kernel's), or None: list it afresh."""
        watched = self.dirs.get(ino)
        if watched is None:
            return None
        attr, stamp = watched
        if not self.trusts(ino, attr["change"], stamp):
            self._drop_dir(ino)
            return None
        return attr

    # ---- names of watched directories -------------------------------------------

    def absent(self, parent: int, name: bytes) -> bool:
        """Is *name* known not to be in directory *parent*? (Its names were
        listed whole and the watch still keeps it.)"""
        names = self.names.get(parent)
        return names is not None and name not in names and self.dir_attr(parent) is not None

    async def learn_names(self, parent: int) -> None:
        """This client created a file in *parent*: list its names, so that
        the next missing names of it are answered here (not when they are held,
        or were listed within `RELEARN` seconds, `LARGE_DIR_WAIT` if they
        did not fit in one page: a directory others change keeps losing
        them)."""
        if parent in self.names or self.token == 0 or not self.names_supported:
            return
        now = trio.current_time()
        if now < self._next_listing.get(parent, now):
            return
        if len(self._next_listing) >= MAX_LISTED:
            self._next_listing = {d: t for d, t in self._next_listing.items() if t > now}
        self._next_listing[parent] = now + RELEARN
        try:
            page = await self.watch_dir(parent, READDIR_MAX)
        except FsError as exc:  # the create stands; its directory's names stay unknown
            log.debug("listing directory %d for its names: %s", parent, exc.message)
            return
        if page is not None and page["more"]:  # too many to hold: not soon again
            self._next_listing[parent] = now + LARGE_DIR_WAIT

    def created(self, parent: int, name: bytes, parent_attr: Attr | None) -> None:
        """This client created *name* in *parent*; *parent_attr*: the
        directory's attributes after it (from the reply)."""
        watched = self.dirs.get(parent)
        if watched is None:
            return
        attr, stamp = watched
        if (
            parent_attr is None
            or parent_attr["change"] != attr["change"] + 1
            or not self.trusts(parent, parent_attr["change"], stamp)
        ):
            self._drop_dir(parent)
            return
        self.dirs[parent] = (parent_attr, stamp)
        names = self.names.get(parent)
        if names is not None and name not in names:
            names.add(name)
            self._names_held += 1
            self._bound_names()

    def changing(self, dirs: Iterable[int]) -> None:
        """This client changes *dirs* otherwise than by a create: what was
        listed of them is not current from here (the server tells the watch
        too, but its reply may come after the change is acknowledged)."""
        for ino in dirs:
            self._drop_dir(ino)

    def forget_names(self, dirs: Iterable[int] | None) -> None:
        """This client changes *dirs* (None: any directory) otherwise than
        by a create: their names are no longer known."""
        for ino in list(self.names) if dirs is None else dirs:
            names = self.names.pop(ino, None)
            if names is not None:
                self._names_held -= len(names)

    def collect(self) -> Iterator[Metric]:
        """The watched directories and names held (when scraped)."""
        family = GaugeMetricFamily(
            "shufflefs_client_watched_dirs",
            "Directories whose listing a read-write mount's cache watch keeps "
            "(what=listings), and those whose names it holds whole (what=named; "
            "their names: what=names), client/cache_watch.py",
            labels=["what"],
        )
        family.add_metric(["listings"], len(self.dirs))
        family.add_metric(["named"], len(self.names))
        family.add_metric(["names"], self._names_held)
        yield family

    def _hold_names(self, ino: int, names: set[bytes]) -> None:
        self.names[ino] = names
        self._names_held += len(names)
        self._bound_names()

    def _bound_names(self) -> None:
        while self._names_held > MAX_NAMES and self.names:
            _, names = self.names.popitem(last=False)
            self._names_held -= len(names)

    def _drop_dir(self, ino: int) -> None:
        self.dirs.pop(ino, None)
        self.forget_names((ino,))

    def _drop_all(self) -> None:
        self.dirs.clear()
        self.names.clear()
        self._names_held = 0

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
        self._drop_all()

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
            self._drop_all()
            self.token = reply["token"]
            self.generation += 1
        now = trio.current_time()
        for ino, change in reply["changed"]:
            self._recent[ino] = (change, now)
            self._changed(ino, change)
            self.forget_names((ino,))
            if self.dirs.pop(ino, None) is not None and self.dir_changed is not None:
                self.dir_changed(ino)
        if len(self._recent) > 4096 or self.replies % 64 == 0:
            self._recent = {i: r for i, r in self._recent.items() if now - r[1] < RECENT}
        self.acked = reply["seq"]
        self.trusted_until = sent + reply["lease"]
        self.replies += 1
