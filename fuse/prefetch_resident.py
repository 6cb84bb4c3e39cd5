"""Warm epochs: hints for files the kernel's page cache holds are skipped
(fuse/prefetch.py).

A hint for a file the kernel's page cache holds (read through
this mount, whole, at the version it still has) is skipped: the kernel
answers its reads, so fetched bytes would only sit in our cache. The mount
cannot see the kernel evict, only reads of skipped files that reach it
anyway. A few such reads are the odd page or file the kernel dropped (the
reads go to storage as any read): the hints go on being skipped. Once at
least EVICTED_MIN of the files skipped lately, and one in EVICTED_SHARE of
them, were read here, the kernel is evicting most files: the other skipped
files not read yet are fetched after all and skipping stops for
DISTRUST_SECONDS (a dataset larger than the page cache is prefetched every
epoch, as before). "Lately" is the last SKIP_WINDOW files skipped, each
counted once: a file hinted again before its read (a loader hinting the
same window twice) is still one file awaiting its read.

Why one in two: fetching a file costs about what reading it from storage
costs (the prefetch's gain is that it happens ahead, on other cores), so
prefetching everything pays only when most skipped files are gone from the
kernel's cache. With one in four and a window of 256 (before), a warm epoch
of a dataset that just fits the page cache (4 readers, 20,000 files of
110 KB, reads through the storage daemons) met a burst of 46 evicted files
(the kernel drops the oldest pages: the first files of the last epoch's
order, the first read again) and fetched the whole epoch again from storage:
3,262 files/s against 24,374 unhinted. (One such read used to be enough:
on a machine whose page cache loses a page now and then, every warm epoch
was fetched whole into memory no read consulted.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import trio

from shufflefs.fuse.prefetch_hints import Hint, Version

DISTRUST_SECONDS = 60.0  # no hint is skipped as held by the kernel this long after one was wrong
EVICTED_MIN = 4  # reads of skipped files that reached the mount before it distrusts...
EVICTED_SHARE = 2  # ...if also one in this many of the files skipped lately
SKIP_WINDOW = 1024  # files skipped, beyond which both counts are halved ("lately")
MAX_SKIPPED = 65536  # skipped hints remembered


class ResidentSkips:
    def __init__(self, kernel_holds: Callable[[int, Version, int], bool]) -> None:
        # does the kernel's page cache hold (ino, version) up to a byte offset?
        self.kernel_holds = kernel_holds
        # skipped files not read yet: their hint and when (`_seq`), newest last
        self.skipped: OrderedDict[int, tuple[Hint, int]] = OrderedDict()
        self._distrust_until = -1.0  # none is skipped until then
        self._seq = 0  # skip decisions so far
        self._lately = 0  # files skipped lately
        self._missed = 0  # ... of which a read reached the mount

    def skip(self, hint: Hint) -> bool:
        """Skip *hint*: the kernel holds its bytes (as far as the mount
        knows; see `missed` for when it stops trusting that)."""
        if hint.version is None or trio.current_time() < self._distrust_until:
            return False
        size = hint.version[0]
        end = size if hint.length is None else min(size, hint.offset + hint.length)
        if not self.kernel_holds(hint.ino, hint.version, end):
            return False
        # (counted here, not at opens: a cache=immutable mount sees none; a
        # file skipped within the window and not read since is counted once)
        self._seq += 1
        before = self.skipped.get(hint.ino)
        if before is None or self._seq - before[1] > SKIP_WINDOW:
            self._lately += 1
            if self._lately > SKIP_WINDOW:
                self._lately //= 2
                self._missed //= 2
        self.skipped[hint.ino] = (hint, self._seq)
        self.skipped.move_to_end(hint.ino)
        if len(self.skipped) > MAX_SKIPPED:
            self.skipped.popitem(last=False)
        return True

    def missed(self, ino: int) -> list[Hint]:
        """A read of skipped *ino* reached the mount: the kernel did not
        have it all. If such reads show it evicting whole files, the other
        skipped files not read yet (to fetch after all, in their order)."""
        self.skipped.pop(ino, None)
        self._missed += 1
        missed, lately = self._missed, self._lately
        if missed < EVICTED_MIN or missed * EVICTED_SHARE < lately:
            return []  # the odd page
        self._distrust_until = trio.current_time() + DISTRUST_SECONDS
        again = [hint for hint, _ in self.skipped.values()]
        self.skipped.clear()
        return again

    def taken(self, ino: int) -> None:
        """A handle of *ino* was closed: a skipped file read from the page
        cache is taken."""
        if self.skipped:
            self.skipped.pop(ino, None)
