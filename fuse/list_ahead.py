"""Listings of the subdirectories after the one being listed, read ahead
(``-o list_ahead=N``, docs/operations.md).

A dataset's first pass is a walk: ``os.walk``, torchvision's ``ImageFolder``
and ``find`` list the root, then each class directory in turn. Through the
mount each of those listings was a metadata round trip the walker waited
for (about 70% of a cold 100-entry directory's time here: the server's
work on one core, then the mount's on the other, one after the other). So
when the mount lists a directory that holds subdirectories, it remembers
them in listing order; when one of them is listed, the first pages of the
N after it are read in the background (`PARALLEL` calls at a time) and
held, and their READDIRPLUS then takes the held page instead of asking.
A directory whose subdirectories nobody lists (``ls`` of the root) costs
nothing: reading ahead starts at the first listing of one of them. A
walker that lists subdirectories by name without listing their parent (a
loader given its class names) gets the same: a listing of a subdirectory
that starts right after one of a sibling (within `WALK_GAP`) makes the mount
list their directory itself, in the background, to learn their order
(`_learn`).

A held page is as fresh as the mode's listings are (fuse/listings.py):

* read-write, with a cache watch: read by `watch_dir`, so the watch tells
  the mount of the directory's next change; the page is taken only while
  the watch still holds the directory at the change counter it was read
  at (`CacheWatch.dir_attr`: a change by another client, or one of this
  client's own, and a lapsed lease all end it). Without a watch nothing is
  held (listings are not kept in that mode either).
* ``ro`` and ``cache=immutable``: taken within ``entry_timeout`` and
  ``attr_timeout`` of its read (`HOLD` seconds at most), and the entries it
  hands the kernel are kept that much less (`entry_attributes`), so a change made
  elsewhere is seen within those timeouts of the listing, as before. The
  lookup of a subdirectory a listing brought is answered from it for as
  long (`lookup`): a walk's next directory needs no round trip.

A directory listed since the kernel last forgot it is not read ahead: the
kernel holds its listing, or another walker listed it (several walkers over
slices of one directory's subdirectories do not read each other's ahead).

Bounded: at most 4N held pages (`PARALLEL` walkers' windows; the oldest
dropped first), each its directory's first page only (`READDIR_PAGE`
entries), none older than `HOLD`; at most `MAX_KNOWN` subdirectories
remembered.
"""

from __future__ import annotations

import logging
import stat
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from prometheus_client.metrics_core import Metric

from shufflefs.cluster.metrics_client import counts_family
from shufflefs.fuse.dir_handles import READDIR_PAGE
from shufflefs.metadata.protocol import Attr, ReaddirPage
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.client.cache_watch import CacheWatch
    from shufflefs.client.fs import FileSystem
    from shufflefs.fuse.watched_entries import WatchedEntries

log = logging.getLogger("shufflefs.fuse.list_ahead")

DEFAULT_DIRS = 8  # subdirectories listed ahead (list_ahead=)
MAX_DIRS = 1024
PARALLEL = 4  # listings in flight at once
HOLD = 10.0  # s a held page may wait for its listing
ARRIVING = 5.0  # s a listing waits for its page being read ahead, at most
LEARN_PAGES = 16  # pages of a parent listed to learn its subdirectories (`_learn`)
WALK_GAP = 1.0  # s between two sibling listings that make a walk (`_walking`)
MAX_LEARNED = 4096  # parents remembered as listed for that
MAX_KNOWN = 1 << 20  # subdirectories remembered (their parents' oldest forgotten first)


@dataclass
class ListAheadCounts:
    """What reading listings ahead did (exported when scraped)."""

    queued: int = 0  # first pages to read ahead (counted as a listing decides it)
    fetched: int = 0  # first pages read ahead and held
    learned: int = 0  # directories listed to learn their subdirectories' order (when started)
    taken: int = 0  # listings answered by a held page
    stale: int = 0  # held pages dropped unused: too old, changed, or evicted
    failed: int = 0  # listings ahead that failed (the listing asks as before)
    # a listing's later pages, read while the kernel took the one before
    # (fuse/listings.py), and those the listing then used
    next_read: int = 0
    next_taken: int = 0

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_list_ahead",
            "Directory listings a mount read ahead of a walk (fuse/list_ahead.py)",
            "what",
            self,
        )


@dataclass
class HeldPage:
    page: ReaddirPage
    fetched: float  # trio time
    change: int | None  # read-write: the directory's change counter the watch held


class ListAhead:
    def __init__(
        self,
        fs: FileSystem,
        watch: CacheWatch | None,
        watched: WatchedEntries | None,
        dirs: int,
        hold: float,
        names_for: float = 0.0,
    ) -> None:
        self.fs = fs
        self.watch = watch  # read-write: held pages are good while it holds their directory
        self.watched = watched
        self.ahead = dirs
        self.hold = hold
        self.names_for = names_for  # read-only: s a listed subdirectory's name answers lookups
        self.counts = ListAheadCounts()
        self.held: OrderedDict[int, HeldPage] = OrderedDict()
        # parent -> its subdirectories (inode, name) in listing order;
        # subdirectory -> (parent, index)
        self._subdirs: OrderedDict[int, list[tuple[int, bytes]]] = OrderedDict()
        self._where: dict[int, tuple[int, int]] = {}
        # read-only: (parent, name) -> (attributes, trio time listed)
        self._names: dict[tuple[int, bytes], tuple[Attr, float]] = {}
        self._known = 0
        self._wanted: deque[int] = deque()
        self._queued: set[int] = set()  # wanted, not yet being read
        self._reading: dict[int, trio.Event] = {}  # being read: set when done
        self._learned: OrderedDict[int, float] = OrderedDict()  # parent -> trio time listed
        # directories listed since the kernel last forgot them: it holds their
        # listing, or another walker is reading it (not read ahead)
        self._listed: OrderedDict[int, None] = OrderedDict()
        # the listing that started last, of a directory not known here:
        # (its parent, its inode, trio time)
        self._last_start: tuple[int, int, float] | None = None
        self._running = 0
        self._nursery: trio.Nursery | None = None
        # is a directory's whole listing kept (fuse/kept_listings.py)? then not read ahead
        self.kept: Callable[[int], bool] = lambda ino: False

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    @property
    def enabled(self) -> bool:
        return self.ahead > 0 and self._nursery is not None

    def listed(self, parent: int, first: bool, entries: Sequence[tuple[bytes, Attr]]) -> None:
        """A page of *parent*'s listing was read (for the kernel, or by
        `_learn`; *first*: its first page): remember its subdirectories, in
        order."""
        if not self.enabled:
            return
        dirs = [(n, a) for n, a in entries if stat.S_ISDIR(a["mode"])]
        if first:
            self._forget(parent)
        if not dirs:
            return
        known = self._subdirs.get(parent)
        if known is None:
            known = self._subdirs[parent] = []
        self._subdirs.move_to_end(parent)
        now = trio.current_time()
        for name, attr in dirs:
            self._where[attr["ino"]] = (parent, len(known))
            known.append((attr["ino"], name))
            if self.names_for:
                self._names[(parent, name)] = (attr, now)
        self._known += len(dirs)
        while self._known > MAX_KNOWN and len(self._subdirs) > 1:
            self._forget(next(iter(self._subdirs)))

    def take(self, ino: int, parent: int) -> tuple[ReaddirPage, float] | None:
        """A listing of *ino* (in directory *parent*) starts: its held first
        page and that page's age in seconds, if one is held and still good;
        the ones after it are read ahead either way (learned first from a
        listing of *parent*, if it was not listed here: `_learn`)."""
        if not self.enabled:
            return None
        self._queued.discard(ino)  # (the listing reads it itself)
        self._listed[ino] = None
        if len(self._listed) > MAX_KNOWN:
            self._listed.popitem(last=False)
        if ino in self._where:
            self._read_after(ino)
        elif self._walking(parent, ino):
            self._learn(parent, ino)
        held = self.held.pop(ino, None)
        if held is None:
            return None
        age = trio.current_time() - held.fetched
        if age > self.hold or not self._current(ino, held):
            self.counts.stale += 1
            return None
        self.counts.taken += 1
        page: ReaddirPage = {
            "entries": self.fs.overlay_entries(held.page["entries"]),
            "more": held.page["more"],
        }
        return page, age

    async def arriving(self, ino: int) -> None:
        """Wait until a first page of *ino* being read ahead is in, if one
        is (a listing takes it rather than read the same page again)."""
        event = self._reading.get(ino)
        if event is not None:
            with trio.move_on_after(ARRIVING):
                await event.wait()

    def lookup(self, parent: int, name: bytes) -> tuple[Attr, float] | None:
        """(read-only) A subdirectory's attributes as a listing brought them,
        and the seconds the kernel may keep them: the lookup of a walk's
        next directory needs no round trip. Good for ``entry_timeout`` (and
        ``attr_timeout``) from the listing, that mode's bound."""
        known = self._names.get((parent, name))
        if known is None:
            return None
        attr, listed = known
        left = listed + self.names_for - trio.current_time()
        if left <= 0:
            del self._names[(parent, name)]
            return None
        return self.fs.overlay(attr), left

    def changed(self, ino: int) -> None:
        """The watch was told of a change of directory *ino* (the kernel's
        listing of it is dropped)."""
        self._listed.pop(ino, None)
        if self.held.pop(ino, None) is not None:
            self.counts.stale += 1

    def forgotten(self, inos: Iterable[int]) -> None:
        """The kernel forgot inodes *inos* (and with them any listing it held)."""
        if self._listed:
            pop = self._listed.pop
            for ino in inos:
                pop(ino, None)

    def _current(self, ino: int, held: HeldPage) -> bool:
        if self.watch is None:
            return True
        attr = self.watch.dir_attr(ino)
        return attr is not None and attr["change"] == held.change

    def _forget(self, parent: int) -> None:
        known = self._subdirs.pop(parent, None)
        if known is None:
            return
        self._known -= len(known)
        for ino, name in known:
            if self._where.get(ino, (0, 0))[0] == parent:
                del self._where[ino]
            self._names.pop((parent, name), None)

    def _walking(self, parent: int, ino: int) -> bool:
        """Did the listing of *ino* start right after one of another
        subdirectory of *parent*, within `WALK_GAP` (a walk, not one ``ls``,
        nor listings of unrelated directories that share a parent)?"""
        now = trio.current_time()
        last, self._last_start = self._last_start, (parent, ino, now)
        return (
            last is not None and last[0] == parent and last[1] != ino and now - last[2] < WALK_GAP
        )

    def _learn(self, parent: int, ino: int) -> None:
        """A walker that lists a directory's subdirectories without listing
        the directory (it knows their names: a loader's class list, a
        benchmark): list *parent* in the background (at most `LEARN_PAGES`
        pages, once per `hold` for each parent), then read ahead after *ino*."""
        now = trio.current_time()
        last = self._learned.get(parent)
        if parent in (0, ino) or (last is not None and now - last < self.hold):
            return
        self._learned[parent] = now
        self._learned.move_to_end(parent)
        self.counts.learned += 1
        while len(self._learned) > MAX_LEARNED:
            self._learned.popitem(last=False)
        assert self._nursery is not None
        self._nursery.start_soon(self._learn_listing, parent, ino)

    async def _learn_listing(self, parent: int, ino: int) -> None:
        after: bytes | None = None
        try:
            for _ in range(LEARN_PAGES):
                page = await self.fs.readdir(parent, after, READDIR_PAGE)
                self.listed(parent, after is None, page["entries"])
                if not page["more"] or not page["entries"]:
                    break
                after = page["entries"][-1][0]
        except FsError as exc:
            self.counts.failed += 1
            log.debug("listing directory %d to read its subdirectories ahead: %s", parent, exc)
            return
        if ino in self._where:
            self._read_after(ino)

    def _read_after(self, ino: int) -> None:
        where = self._where.get(ino)
        if where is None:
            return
        parent, index = where
        for after, _ in self._subdirs[parent][index + 1 : index + 1 + self.ahead]:
            if (
                after not in self.held
                and after not in self._queued
                and after not in self._reading
                and after not in self._listed
                and not self.kept(after)
            ):
                self._queued.add(after)
                self._wanted.append(after)
                self.counts.queued += 1
        assert self._nursery is not None
        while self._wanted and self._running < PARALLEL:
            self._running += 1
            self._nursery.start_soon(self._reader)

    async def _reader(self) -> None:
        try:
            while self._wanted:
                ino = self._wanted.popleft()
                if ino not in self._queued:
                    continue  # its listing started meanwhile
                self._queued.discard(ino)
                done = self._reading[ino] = trio.Event()
                try:
                    await self._read(ino)
                finally:
                    del self._reading[ino]
                    done.set()
        finally:
            self._running -= 1

    async def _read(self, ino: int) -> None:
        try:
            page = await self.fs.readdir(ino, None, READDIR_PAGE, watch=self.watch is not None)
        except FsError as exc:
            self.counts.failed += 1
            log.debug("listing directory %d ahead: %s", ino, exc.message)
            return
        change = None
        if self.watch is not None:
            attr = self.watch.dir_attr(ino)
            if attr is None:  # not watched: such a listing is not kept
                return
            change = attr["change"]
            where = self._where.get(ino)
            if self.watched is not None and where is not None:
                parent, index = where
                # its LOOKUP too is answered while the watch holds it
                self.watched.directory(ino, parent, self._subdirs[parent][index][1])
        self.held[ino] = HeldPage(page, trio.current_time(), change)
        self.counts.fetched += 1
        while len(self.held) > self.ahead * PARALLEL:
            self.held.popitem(last=False)
            self.counts.stale += 1
