"""Warm epochs: hints for files the kernel's page cache holds are skipped
(fuse/prefetch.py).

A hint for a file the kernel's page cache holds (read through
this mount, whole, at the version it still has) is skipped: the kernel
answers its reads, so fetched bytes would only sit in our cache. The mount
cannot see the kernel evict, only reads of skipped files that reach it
anyway. A few such reads are the odd page the kernel dropped (the reads
are small, and go to storage as any read): the hints go on being skipped.
Once at least EVICTED_MIN of the files skipped lately, and one in
EVICTED_SHARE of them, were read here, the kernel is evicting whole files:
the other skipped files not read yet are fetched after all and skipping
stops for DISTRUST_SECONDS (a dataset larger than the page cache is
prefetched every epoch, as before). (One such read used to be enough: on a
machine whose page cache loses a page now and then, every warm epoch was
fetched whole into memory no read consulted, slower than no hints at all.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import trio

from shufflefs.fuse.prefetch_hints import Hint, Version

DISTRUST_SECONDS = 60.0  # no hint is skipped as held by the kernel this long after one was wrong
EVICTED_MIN = 4  # reads of skipped files that reached the mount before it distrusts...
EVICTED_SHARE = 4  # ...if also one in this many of the files skipped lately
SKIP_WINDOW = 256  # files skipped, beyond which both counts are halved ("lately")
MAX_SKIPPED = 65536  # skipped hints remembered


class ResidentSkips:
    def __init__(self, kernel_holds: Callable[[int, Version, int], bool]) -> None:
        # does the kernel's page cache hold (ino, version) up to a byte offset?
        self.kernel_holds = kernel_holds
        self.skipped: OrderedDict[int, Hint] = OrderedDict()  # newest last
        self._distrust_until = -1.0  # none is skipped until then
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
        # (counted here, not at opens: a cache=immutable mount sees none)
        self._lately += 1
        if self._lately > SKIP_WINDOW:
            self._lately //= 2
            self._missed //= 2
        self.skipped[hint.ino] = hint
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
        again = list(self.skipped.values())
        self.skipped.clear()
        return again

    def taken(self, ino: int) -> None:
        """A handle of *ino* was closed: a skipped file read from the page
        cache is taken."""
        if self.skipped:
            self.skipped.pop(ino, None)
