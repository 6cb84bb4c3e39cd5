"""Warm epochs: hints for files the kernel's page cache holds are skipped
(fuse/prefetch.py).

A hint for a file the kernel's page cache holds (read through this mount,
whole, at the version it still has) is skipped: the kernel answers its
reads, so fetched bytes would only sit in our cache. The mount cannot see
the kernel evict, only reads of skipped files that reach it anyway
(`missed`). So it keeps the fate of the last RESOLVED skipped files: a
read reached it (evicted), or it did not: the handle was closed with no
read here (`taken`), or files hinted after it were read here first (a
`cache=immutable` mount sees no opens or closes: the loader reads in the
order it hints, so a file still waiting more than SLACK hints behind one
read here was read from the page cache).

Once at least EVICTED_MIN of those, and one in EVICTED_SHARE, were
evicted, the kernel is evicting whole files: the next SPAN skipped files
not read yet are fetched after all, the next SPAN hints are not skipped,
and the count starts over. If it distrusts again before RESOLVED files
were mostly found held, the span doubles: a dataset larger than the page
cache is fetched nearly whole, each epoch, after some EVICTED_MIN to
MIN_RESOLVED cold reads per doubling.

Why a bounded response, and one in two: fetching a file costs about what
reading it from storage costs (the prefetch's gain is that it happens
ahead, on other cores), so it pays only for files more likely gone than
not; and the evictions of a warm epoch come in bursts. The kernel drops
the oldest pages: the first files of the last epoch's order, which are the
first read again when the order repeats (a benchmark's warm passes). Four
readers of 20,000 files of 110 KB that nearly fill the page cache met 46
such files at the start of a pass; the rule before (one in four of the
last 256 skips, then no skipping for 60 s) fetched the whole epoch through
the storage daemons: 3,180 samples/s hinted against 20,232 unhinted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from shufflefs.fuse.prefetch_hints import Hint, Version

EVICTED_MIN = 4  # evicted among the files resolved lately before the mount distrusts...
EVICTED_SHARE = 2  # ...if also one in this many of them
RESOLVED = 64  # skipped files whose fate is remembered ("lately")
MIN_RESOLVED = 16  # ...and how many must be known before a share says anything
SLACK = 1024  # hints by which a read may run out of the order they were sent in
SPAN = 256  # skipped files not read yet fetched after all, and hints not skipped after
MAX_SKIPPED = 65536  # skipped hints remembered


class ResidentSkips:
    def __init__(self, kernel_holds: Callable[[int, Version, int], bool]) -> None:
        # does the kernel's page cache hold (ino, version) up to a byte offset?
        self.kernel_holds = kernel_holds
        # skipped files not read yet: their hint and its place in the order
        # the hints came in (`_seq`), in that order
        self.skipped: OrderedDict[int, tuple[Hint, int]] = OrderedDict()
        self._seq = 0  # hints the kernel holds, so far
        self._fates: deque[bool] = deque()  # evicted? of the last RESOLVED resolved
        self._evicted = 0  # ... how many
        self._distrust = 0  # hints not to skip, from now on
        self._span = SPAN  # what the next distrust fetches and does not skip

    def skip(self, hint: Hint) -> bool:
        """Skip *hint*: the kernel holds its bytes (as far as the mount
        knows; see `missed` for when it stops trusting that)."""
        if hint.version is None:
            return False
        size = hint.version[0]
        end = size if hint.length is None else min(size, hint.offset + hint.length)
        if not self.kernel_holds(hint.ino, hint.version, end):
            return False
        self._seq += 1
        if self._distrust:
            self._distrust -= 1
            return False
        # (a file hinted again is awaited where its last hint puts it)
        self.skipped[hint.ino] = (hint, self._seq)
        self.skipped.move_to_end(hint.ino)
        if len(self.skipped) > MAX_SKIPPED:
            self.skipped.popitem(last=False)
        return True

    def missed(self, ino: int) -> list[Hint]:
        """A read of skipped *ino* reached the mount: the kernel did not
        have it all. If such reads show it evicting whole files, the next
        skipped files not read yet (to fetch after all, in their order)."""
        entry = self.skipped.pop(ino, None)
        if entry is None:
            return []
        self._passed(entry[1] - SLACK)
        self._resolved(True)
        evicted, known = self._evicted, len(self._fates)
        if evicted < EVICTED_MIN or known < MIN_RESOLVED or evicted * EVICTED_SHARE < known:
            return []  # the odd page or file
        self._fates.clear()
        self._evicted = 0
        self._distrust = span = self._span
        self._span = min(2 * span, MAX_SKIPPED)  # unless found held meanwhile (`_resolved`)
        again: list[Hint] = []
        while self.skipped and len(again) < span:
            again.append(self.skipped.popitem(last=False)[1][0])
        return again

    def taken(self, ino: int) -> None:
        """A handle of *ino* was closed: a skipped file read from the page
        cache is taken."""
        if self.skipped and self.skipped.pop(ino, None) is not None:
            self._resolved(False)

    def _passed(self, seq: int) -> None:
        """Skipped files hinted before *seq* and not read here: taken."""
        while self.skipped:
            ino, (_, at) = next(iter(self.skipped.items()))
            if at >= seq:
                return
            del self.skipped[ino]
            self._resolved(False)

    def _resolved(self, evicted: bool) -> None:
        fates = self._fates
        fates.append(evicted)
        self._evicted += evicted
        if len(fates) > RESOLVED:
            self._evicted -= fates.popleft()
        if len(fates) == RESOLVED and self._evicted * EVICTED_SHARE * 2 < RESOLVED:
            self._span = SPAN  # mostly held lately: the next distrust starts small
