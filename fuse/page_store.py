"""Prefetched bytes handed to the kernel's page cache (``notify_store``).

A hinted file the kernel already knows (a lookup or a listing's
readdirplus gave it the inode, and the attributes it holds are of the
version fetched) does not wait in the prefetcher's cache for the reader's
READs: its bytes go into the kernel's page cache at once, and the reader's
open, reads and close are answered by the kernel with no round trip to
this process, as in a warm epoch. A file the kernel does not know (ENOENT:
nobody looked it up or listed its directory since the kernel dropped it)
stays in the prefetcher's own cache, as before.

Why it is safe:

* the stored bytes are of the version whose attributes the kernel holds
  (so its i_size is that version's size), and the kernel's pages of the
  file, if any, are of the same version (``cached``): an open keeps them
  (``keep_cache``) exactly when it would keep pages a READ brought in;
* the store runs in a thread: the kernel locks each page it fills, and a
  page locked by a READ waits for this process's event loop to answer it;
* a file that changed through this mount while its bytes were stored
  (a write, a truncate) has its pages dropped again afterwards.

What it costs: stored pages are page cache, which the kernel reclaims
under memory pressure like any other file's; the mount's ``prefetch_memory``
bounds only the bytes it holds itself. How far ahead of the reads the
stored bytes run is the loader's lookahead (the hints it sends), at most
``MAX_PENDING`` hinted ranges.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Protocol

import pyfuse3
import trio

from shufflefs.fuse.prefetch_hints import Version

log = logging.getLogger("shufflefs.fuse.page_store")

PIECE = 1 << 20  # bytes per notify_store call (one write to /dev/fuse each)

# (inode, version, [(offset, bytes)]) of one fetched file
Fetched = tuple[int, Version, list[tuple[int, memoryview]]]


class PageView(Protocol):
    """What the mount knows of the kernel's caches (fuse/ops.py)."""

    lookups: dict[int, int]
    cached: dict[int, Version]
    reported: dict[int, Version]
    read_through: dict[int, int]


class KernelPages:
    def __init__(self, view: PageView) -> None:
        self.view = view
        self.enabled = True  # off for good once the kernel says ENOSYS

    def holds(self, ino: int, version: Version, end: int) -> bool:
        """Does the kernel's page cache hold *ino*'s bytes up to *end* at
        *version*? (As far as this mount can know: the kernel may have
        evicted pages since; then a read is just not prefetched.)"""
        view = self.view
        return view.cached.get(ino) == version and view.read_through.get(ino, 0) >= end

    def storable(self, ino: int, version: Version) -> bool:
        """Would the kernel take *ino*'s bytes of *version* (as far as this
        mount knows)?"""
        view = self.view
        return (
            self.enabled
            and view.lookups.get(ino, 0) > 0
            and view.reported.get(ino) == version
            and view.cached.get(ino, version) == version
        )

    async def store(
        self, files: list[Fetched], changed: Callable[[int], bool], skip: Callable[[int], bool]
    ) -> set[int]:
        """Store what of *files* the kernel takes; the inodes stored.
        *changed* tells whether a file changed since its bytes were read,
        *skip* whether it need not be stored any more (asked as it comes)."""
        todo = [f for f in files if self.storable(f[0], f[1]) and not changed(f[0])]
        if not todo:
            return set()
        for ino, version, _ in todo:
            # an open while the bytes go in keeps them (and what it finds)
            self.view.cached[ino] = version
        done = await trio.to_thread.run_sync(self._store_all, todo, skip)
        stored = set()
        for ino, version, chunks in todo:
            if ino not in done:
                continue
            if changed(ino) or self.view.cached.get(ino) != version:
                # written or truncated here meanwhile: the stored pages may
                # be older than the kernel's own
                await trio.to_thread.run_sync(invalidate_pages, ino)
                continue
            stored.add(ino)
            through = self.view.read_through.get(ino, 0)
            for off, data in sorted(chunks):
                if off <= through:
                    through = max(through, off + len(data))
            self.view.read_through[ino] = through
        return stored

    def _store_all(self, files: list[Fetched], skip: Callable[[int], bool]) -> set[int]:
        done = set()
        for ino, _, chunks in files:
            if skip(ino):
                continue
            try:
                for off, data in chunks:
                    for at in range(0, max(len(data), 1), PIECE):
                        piece: bytes = data[at : at + PIECE]  # type: ignore[assignment]
                        pyfuse3.notify_store(ino, off + at, piece)  # (any buffer)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    self.enabled = False
                    log.warning("the kernel takes no stored pages (notify_store: ENOSYS)")
                    break
                if exc.errno != errno.ENOENT:  # ENOENT: the kernel forgot the inode
                    log.debug("notify_store(%d): %s", ino, exc)
                continue
            done.add(ino)
        return done


def invalidate_pages(ino: int) -> None:
    """Drop the kernel's pages (and attributes) of *ino*; in a thread (the
    kernel waits for any page under a READ, which the event loop answers)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=False)
    except OSError as exc:
        log.debug("invalidate_inode(%d): %s", ino, exc)
