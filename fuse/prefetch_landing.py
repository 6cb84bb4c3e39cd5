"""Readers that catch up with the prefetcher (fuse/prefetch.py): bytes of a
prefetch read from the moment its files are taken until they are stored or
kept (fuse/page_store.py), and files a reader got to first.

A reader that catches up with the prefetcher asks for a file whose bytes
are being read for it right now. Its READ used to read them a second time
from storage, and at the front of a cold epoch that is most READs: the
mount did the work twice exactly where it was shortest of time. Now such a
READ waits for the prefetch read (`wait`) and is answered from its buffer
(`read`), as are READs that come while the bytes go into the kernel's page
cache.

The wait ends when the bytes arrive, before they are stored: the store
fills pages that the waiting READ holds locked, and waits for its answer.

A reader that got to a file before its hint was taken at all is past it: the
whole-file hint is `late`, dropped rather than fetched.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import trio

from shufflefs.fuse.prefetch_hints import Hint, Version

LANDING_WAIT = 5.0  # s a READ waits for a prefetch read of its file before reading itself
MAX_PASSED = 65536  # files remembered as read before their hint's turn

Chunks = list[tuple[int, memoryview]]  # (file offset, bytes)


class Landing:
    def __init__(self) -> None:
        self.fetching: dict[int, trio.Event] = {}  # inode -> set when its bytes arrived
        self.landed: dict[int, tuple[Version, Chunks]] = {}
        self.served: set[int] = set()  # landed files a READ was answered from
        # inode -> time.monotonic() of the last READ of it that no prefetched
        # bytes answered while hints were queued (`late`)
        self.passed_at: OrderedDict[int, float] = OrderedDict()

    def begin(self, inos: list[int]) -> dict[int, trio.Event]:
        """A prefetch read of *inos* starts; the events it sets (not those
        of another read of the same file already under way)."""
        mine = {}
        for ino in inos:
            if ino not in self.fetching:
                mine[ino] = self.fetching[ino] = trio.Event()
        return mine

    def arrived(self, version: Version, ino: int, chunks: Chunks) -> None:
        self.landed[ino] = (version, chunks)

    def end(
        self, mine: dict[int, trio.Event], keep: set[int] | frozenset[int] = frozenset()
    ) -> dict[int, trio.Event]:
        """The read of *mine* is over (their bytes arrived, or it failed, or
        it is not for them after all) except for *keep*: waiters go on.
        Returns those kept."""
        kept = {}
        for ino, event in mine.items():
            if ino in keep:
                kept[ino] = event
                continue
            if self.fetching.get(ino) is event:
                del self.fetching[ino]
            event.set()
        return kept

    def settled(self, inos: list[int]) -> None:
        """The bytes are stored or kept (or dropped): no longer here."""
        for ino in inos:
            self.landed.pop(ino, None)
            self.served.discard(ino)

    def drop(self, ino: int, unless: Version | None = None) -> None:
        """*ino* changed (or was opened at *unless*'s other version)."""
        held = self.landed.get(ino)
        if held is not None and held[0] != unless:
            del self.landed[ino]

    def version(self, ino: int) -> Version | None:
        held = self.landed.get(ino)
        return held[0] if held is not None else None

    def read(self, ino: int, offset: int, size: int) -> memoryview | None:
        held = self.landed.get(ino)
        if held is None:
            return None
        version, chunks = held
        for start, data in chunks:
            end = min(offset + size, version[0])
            if start <= offset <= end <= start + len(data):
                self.served.add(ino)  # (the kernel has what its reader asked for)
                return data[offset - start : end - start]
        return None

    def passed(self, ino: int) -> None:
        """A READ of *ino* that no prefetched bytes answered (also called
        from the FUSE thread of fuse/fast_reads.py)."""
        self.passed_at.pop(ino, None)
        self.passed_at[ino] = time.monotonic()
        if len(self.passed_at) > MAX_PASSED:
            self.passed_at.popitem(last=False)

    def late(self, hint: Hint) -> bool:
        """Was *hint*'s whole file read after the hint was queued?"""
        return hint.length is None and self.passed_at.get(hint.ino, 0.0) > hint.at

    async def wait(self, ino: int) -> bool:
        """Wait (a while at most) for a prefetch read of *ino* under way;
        whether its bytes are here now."""
        event = self.fetching.get(ino)
        if event is None:
            return False
        with trio.move_on_after(LANDING_WAIT):
            await event.wait()
        return ino in self.landed
