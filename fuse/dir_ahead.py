"""A directory's files opened ahead on its first lookup that missed the
mount's caches (``-o dir_ahead=N``, docs/operations.md).

A loader that reads one file per sample in shuffled order looks every file
up again in an epoch that comes after the open cache let its handles go
(``handle_linger``) or after the kernel dropped its entries: each such
LOOKUP is a metadata round trip (`FileSystem.lookup_open`), the largest share
of a cold sample's cost through the mount after the disk read itself. So the
first miss in a directory lists it (up to N entries, readdir pages) and
opens its regular files read-only in one call (`OpenCache.open_ahead`, as
the prefetcher does for hinted files); the other names then answer their
LOOKUPs from the mount's caches: on a read-write mount through its cache
watch (`WatchedEntries.learn`), which keeps them as fresh as names a LOOKUP
brought; on ``-o ro`` for ``entry_timeout`` (that mode's bound on seeing
changes made elsewhere: `lookup`).

Every listed file whose handle the open cache holds is learned, whether
opened here or held already (by the lookup that missed, through another name,
by a prefetch of hinted files, or from the last epoch when its names have
aged out): those were once left out, so a directory listed after a hinted
epoch learned no name and the next epoch's every lookup was a metadata call
(eight processes reading cold 110 KB samples of 8,000 after a hinted pass:
1,988-2,104 samples/s, 2,978-3,680 with them learned).

A listing stands for that first lookup once one of its files is opened: a
loader that walks its dataset before reading it (an ImageFolder) gives the
kernel every name in READDIRPLUS, so none of its LOOKUPs miss, and its first
epoch was left with an open round trip per file. The directory a listing
showed a file in is remembered (`listed`), and the file's first open that
the open cache cannot answer (`opened`: the OPEN, or on cache=immutable the
first READ) opens the rest of the directory ahead as a missed LOOKUP does.

A name is taken only if the file's change counter at the open (or of the
handle held) is the one the listing showed: the name was still its name then
(an unlink or rename of it, or over it, changes it), and from the open on the
watch tells the mount of every change (read-write). A listing from a follower
that lags is caught the same way.

Bounded: a directory at most once per ``handle_linger`` (its handles are
held that long; on ``-o ro`` once per ``entry_timeout`` if that is shorter,
as its names answer no longer); N entries of it at most; only while the open
cache is under half its limit (each handle is the metadata server's memory, and a file
removed elsewhere keeps its space while a handle of it is held: the linger
bounds both, as for any cached open). On cache=immutable the handle a
learned name finds in the open cache is the one its first READ takes
(`InodeReads.take_now`), as after a lookup that asked.
"""

from __future__ import annotations

import logging
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from prometheus_client.metrics_core import Metric

from shufflefs.cluster.metrics_client import counts_family
from shufflefs.fuse.dir_handles import READDIR_PAGE
from shufflefs.metadata.protocol import READDIR_MAX, Attr
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.client.fs import FileSystem
    from shufflefs.client.open_cache import CachedOpen
    from shufflefs.fuse.watched_entries import WatchedEntries

log = logging.getLogger("shufflefs.fuse.dir_ahead")

DEFAULT_ENTRIES = 1024  # entries of one directory opened ahead (dir_ahead=)
MAX_ENTRIES = 65536
MAX_DIRS = 65536  # directories remembered as done (the oldest forgotten first)
OPEN_BATCH = READDIR_MAX  # files opened per call (`open_read_only` takes no more)


@dataclass
class DirAheadCounts:
    """Directories listed and files opened ahead (exported when scraped)."""

    dirs: int = 0  # directories listed and opened ahead
    files: int = 0  # their files opened (names learned)
    held: int = 0  # their files whose handles were held already (names learned too)
    changed: int = 0  # files whose counter moved between listing and open
    skipped: int = 0  # misses not acted on: the open cache half full
    aside: int = 0  # misses not acted on: a loader hints its order (the prefetcher's)
    failed: int = 0  # listings or opens that failed (the LOOKUPs ask as before)

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_dir_ahead",
            "Directories whose files a mount opened ahead on a lookup miss (fuse/dir_ahead.py)",
            "what",
            self,
        )


class DirAhead:
    def __init__(
        self,
        fs: FileSystem,
        watched: WatchedEntries | None,
        entries: int,
        entry_timeout: float,
        aside: Callable[[], bool] = lambda: False,
    ) -> None:
        self.fs = fs
        # True while a loader hints its order: the prefetcher fetches its
        # files by their layouts, with no open, so opening their directories
        # ahead only doubles the work (four hinted readers of a fresh mount
        # read 5-15% fewer samples per second with it)
        self.aside = aside
        self.watched = watched  # read-write: the cache watch keeps learned names fresh
        self.max_entries = entries
        self.entry_timeout = entry_timeout  # -o ro: how long a learned name answers
        self.counts = DirAheadCounts()
        self._busy: set[int] = set()
        self._done: OrderedDict[int, float] = OrderedDict()  # directory -> trio time
        # -o ro: (parent, name) -> (inode, trio time learned)
        self.names: dict[tuple[int, bytes], tuple[int, float]] = {}
        self._listed_in: dict[int, int] = {}  # file -> the directory a listing showed it in

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.fs.open_cache.enabled

    def missed(self, parent: int, attr: Attr, nursery: trio.Nursery) -> None:
        """A LOOKUP in *parent* went to the metadata server and found *attr*:
        open the directory's other files ahead (in the background) unless
        that was done within the linger or the cache is half full."""
        if not self.enabled or not stat.S_ISREG(attr["mode"]) or parent in self._busy:
            return
        if self.aside():
            self.counts.aside += 1
            return
        now = trio.current_time()
        cache = self.fs.open_cache
        done = self._done.get(parent)
        if done is not None and now - done < self._again_after(cache.linger):
            return
        if len(cache.entries) * 2 >= cache.limit:
            self.counts.skipped += 1
            return
        self._busy.add(parent)
        nursery.start_soon(self._open_ahead, parent)

    def listed(self, parent: int, entries: Iterable[tuple[bytes, Attr]]) -> None:
        """A page of directory *parent* that a listing handed the kernel:
        the kernel now has its names, so an open of one of its files asks no
        LOOKUP first. Its first open the open cache cannot answer opens the
        directory ahead as a LOOKUP miss does (`opened`): a loader that walks
        its dataset before reading it (an ImageFolder) was otherwise left
        with an open round trip per file. Remembered for up to the open
        cache's limit of files (the room it opens ahead into is half that)."""
        if not self.enabled:
            return
        self.listed_files(parent, [a["ino"] for _, a in entries if stat.S_ISREG(a["mode"])])

    def listed_files(self, parent: int, inos: list[int]) -> None:
        """`listed`, for the regular files *inos* of directory *parent*
        (a kept listing's: fuse/kept_listings.py)."""
        if not self.enabled:
            return
        where = self._listed_in
        if len(where) >= self.fs.open_cache.limit:
            where.clear()
        where.update(dict.fromkeys(inos, parent))

    def opened(self, attr: Attr, nursery: trio.Nursery) -> None:
        """The metadata server opened *attr*'s file (the open cache could
        not answer): if a listing showed it, open its directory ahead."""
        parent = self._listed_in.pop(attr["ino"], None)
        if parent is not None:
            self.missed(parent, attr, nursery)

    def _again_after(self, linger: float) -> float:
        """Seconds before a directory is listed ahead again: its handles'
        linger; on ``-o ro`` no longer than its names answer (`lookup`), or
        a miss after they aged out would leave every lookup of the directory
        to ask until the linger ends (the handles held then are learned
        again, not reopened)."""
        return linger if self.watched is not None else min(linger, self.entry_timeout)

    def lookup(self, parent: int, name: bytes) -> tuple[Attr, float] | None:
        """(``-o ro``) The attributes of a name learned here while its handle
        is still cached, and the seconds left until it is ``entry_timeout``
        old (the kernel keeps it no longer: a change made elsewhere is seen
        within that mode's bound)."""
        known = self.names.get((parent, name))
        if known is None:
            return None
        ino, learned = known
        entry = self.fs.open_cache.entries.get(ino)
        left = learned + self.entry_timeout - trio.current_time()
        if entry is None or left <= 0:
            del self.names[(parent, name)]
            return None
        return self.fs.overlay(entry.attr), left

    async def _open_ahead(self, parent: int) -> None:
        try:
            listed = await self._list(parent)
            cache = self.fs.open_cache
            room = max(0, cache.limit // 2 - len(cache.entries))
            wanted = [(n, a) for n, a in listed if a["ino"] not in cache.entries][:room]
            held: dict[int, CachedOpen] = {}
            for lo in range(0, len(wanted), OPEN_BATCH):  # (the server's bound per call)
                part = wanted[lo : lo + OPEN_BATCH]
                held.update(await cache.open_ahead([a["ino"] for _, a in part]))
        except FsError as exc:
            self.counts.failed += 1
            log.debug("opening directory %d ahead: %s", parent, exc.message)
            return
        finally:
            self._busy.discard(parent)
            self._done[parent] = trio.current_time()
            self._done.move_to_end(parent)
            while len(self._done) > MAX_DIRS:
                self._done.popitem(last=False)
        self.counts.dirs += 1
        now = trio.current_time()
        cached = self.fs.open_cache.entries
        for name, attr in listed:
            # opened here, or a handle held already (this name's lookup
            # brought it, another name of the file, a prefetch of hinted
            # files): the name is learned either way, or its lookups all ask
            opened = held.get(attr["ino"])
            entry = opened or cached.get(attr["ino"])
            if entry is None:
                continue  # not opened: past the room, or gone since the listing
            if entry.attr["change"] != attr["change"]:
                self.counts.changed += 1
                continue
            if opened is not None:
                self.counts.files += 1
            else:
                self.counts.held += 1
            if self.watched is not None:
                self.watched.learn(parent, name, attr["ino"])
            else:
                self.names[(parent, name)] = (attr["ino"], now)
        if len(self.names) > self.fs.open_cache.limit:
            self._drop_stale(now)

    async def _list(self, parent: int) -> list[tuple[bytes, Attr]]:
        """The regular files of *parent*, up to the bound, in name order."""
        out: list[tuple[bytes, Attr]] = []
        after: bytes | None = None
        while len(out) < self.max_entries:
            page = await self.fs.readdir(parent, after, min(READDIR_PAGE, self.max_entries))
            for name, attr in page["entries"]:
                if stat.S_ISREG(attr["mode"]):
                    out.append((name, attr))
            if not page["more"] or not page["entries"]:
                break
            after = page["entries"][-1][0]
        return out[: self.max_entries]

    def _drop_stale(self, now: float) -> None:
        """(-o ro) Names past their time, then the oldest learned, until
        no more are kept than the open cache keeps handles."""
        for key in [k for k, (_, t) in self.names.items() if now - t > self.entry_timeout]:
            del self.names[key]
        over = len(self.names) - self.fs.open_cache.limit
        for key in list(self.names)[: max(0, over)]:
            del self.names[key]
