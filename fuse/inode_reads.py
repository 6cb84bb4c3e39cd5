"""The ``cache=immutable`` mount's read handles, kept by inode.

That mount answers OPEN with ENOSYS (docs/operations.md, "Mount modes and
caches"): the kernel sends no OPEN, FLUSH or RELEASE for the rest of the
mount and keeps every file's pages, so a warm open+read+close never reaches
this process. A READ that does (pages not cached) names only its inode
(fuse/read_inode.py); `InodeReads.handle` opens that inode read-only through
the client on its first READ (one metadata call, or none when the open cache
holds it), and keeps the handle for the next READs.

Closes are not seen, so a handle is given back once no READ used it for
``handle_linger`` (the sweep), when the kernel forgets the inode, beyond
`MAX_HANDLES` (the least recently read first), or when fresh attributes show
the file changed (`changed`: its pages are dropped as well, so the next
reads fetch the new bytes).
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from typing import Protocol

import pyfuse3
import trio

from shufflefs.client.fs import FileSystem
from shufflefs.fuse.prefetch import Prefetcher
from shufflefs.fuse.prefetch_hints import Version, version_of
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.fuse")

MAX_HANDLES = 4096
SWEEP_MIN = 0.5  # s between sweeps, at least
SWEEP_MAX = 30.0  # s between sweeps, at most


class KernelView(Protocol):
    """What the FUSE operations (fuse/ops.py) track of the kernel's caches."""

    fs: FileSystem
    prefetch: Prefetcher
    cached: dict[int, Version]  # inode -> version of the data its pages hold
    read_through: dict[int, int]  # inode -> bytes from 0 handed to the kernel

    def kernel_opened(self, attr: Attr) -> bool: ...

    def handed(self, ino: int, off: int, n: int) -> None: ...

    def opened_at_server(self, attr: Attr) -> None: ...


class InodeReads:
    def __init__(self, view: KernelView, linger: float, limit: int = MAX_HANDLES) -> None:
        self.view = view
        self.fs = view.fs
        self.linger = linger
        self.limit = max(1, limit)
        self.handles: OrderedDict[int, tuple[int, float]] = OrderedDict()  # ino -> (fh, last READ)
        self._opening: dict[int, trio.Event] = {}

    def held(self, ino: int) -> int | None:
        """The handle that reads *ino* if one is open (noted as just used)."""
        held = self.handles.get(ino)
        if held is None:
            return None
        self.handles[ino] = (held[0], trio.current_time())
        self.handles.move_to_end(ino)
        return held[0]

    async def handle(self, ino: int) -> int:
        """The client file handle that reads *ino* (opened on first use)."""
        while True:
            fh = self.held(ino)
            if fh is not None:
                return fh
            waiting = self._opening.get(ino)
            if waiting is None:
                break
            # a concurrent READ of the inode is opening it: take its handle
            # (or, if that open failed, try again and get the error here)
            await waiting.wait()
        done = self._opening[ino] = trio.Event()
        try:
            f, attr = await self.fs.open(ino, os.O_RDONLY)
            self.view.opened_at_server(attr)
            if attr["nlink"] == 0:
                await self.fs.release(f.fh)
                raise FsError(errno.ESTALE, f"inode {ino} was removed")
            self._opened(attr)
            self.handles[ino] = (f.fh, trio.current_time())
        finally:
            del self._opening[ino]
            done.set()
        await self._trim()
        return f.fh

    def read_unopened(self, ino: int, off: int, size: int) -> memoryview | None:
        """A READ of a file with no handle here, answered from prefetched
        bytes if they have it (no open: the bytes were read under a handle of
        the prefetcher's, at a version no older than the kernel's pages of
        the file)."""
        view = self.view
        version = view.prefetch.version_held(ino)
        if version is None or view.cached.get(ino, version) != version:
            view.prefetch.passed(ino)
            return None
        got = view.prefetch.read(ino, off, size)
        if got is not None:
            view.cached[ino] = version  # what the kernel's pages of it now hold
            view.handed(ino, off, len(got))
        return got

    async def read_prefetching(self, ino: int, off: int, size: int) -> memoryview | None:
        """`read_unopened` once the prefetch read of *ino* under way (if
        any) brought its bytes."""
        if await self.view.prefetch.fetched(ino):
            return self.read_unopened(ino, off, size)
        return None

    async def drop(self, ino: int) -> None:
        """Give *ino*'s handle back (if any)."""
        held = self.handles.pop(ino, None)
        if held is None:
            return
        self.view.prefetch.released(ino)
        try:
            await self.fs.release(held[0])
        except FsError as exc:  # a handle the server lost with its session is gone anyway
            log.debug("release of inode %d: %s", ino, exc)

    def take_now(self, ino: int, nursery: trio.Nursery) -> int | None:
        """The handle that reads *ino*, or on its first READ here one taken
        from the open cache with no wait (the cached open a lookup or a
        listing brought, `FileSystem.lookup_open`, fuse/dir_ahead.py), so the
        READ stays on the fast path (fuse/fast_reads.py); None: `handle`
        must open it. Taken by the READ, not by the lookup: a lookup or stat
        that no READ follows costs no handle."""
        fh = self.held(ino)
        if fh is not None or ino in self._opening:
            return fh
        cached = self.fs.open_cache.entries.get(ino)
        if cached is None or cached.attr["nlink"] == 0:
            return None  # (`handle` gives a removed one back and says ESTALE)
        hit = self.fs.open_now(ino, os.O_RDONLY)
        if hit is None:
            return None
        f, opened = hit
        self._opened(opened)
        self.handles[ino] = (f.fh, trio.current_time())
        if len(self.handles) > self.limit:
            nursery.start_soon(self._trim)
        return f.fh

    async def _trim(self) -> None:
        while len(self.handles) > self.limit:
            old, _ = next(iter(self.handles.items()))
            await self.drop(old)

    def current(self, attr: Attr) -> bool:
        """Are the kernel's pages of the file (if any) of *attr*'s version?
        (`pages_current` has nothing to do.)"""
        return self.view.cached.get(attr["ino"], version_of(attr)) == version_of(attr)

    def _opened(self, attr: Attr) -> None:
        self.view.kernel_opened(attr)  # as an OPEN would (no stale size, pages tracked)
        self.view.prefetch.opened(attr)

    def _stale(self, ino: int, version: Version) -> bool:
        """Does *version* of *ino* show a change since the kernel's pages of
        it were read? (Then they are forgotten here at once.)"""
        view = self.view
        if view.cached.get(ino, version) == version:
            return False
        view.cached.pop(ino, None)
        view.read_through.pop(ino, None)
        return True

    async def pages_current(self, attr: Attr) -> None:
        """Before a lookup or getattr answers with attributes of a changed
        file: its old pages are gone, so the reads after the answer get the
        new bytes."""
        if self._stale(attr["ino"], version_of(attr)):
            await self.changed(attr["ino"])

    def seen(self, ino: int, nursery: trio.Nursery, version: Version) -> None:
        """Any attributes handed to the kernel (a listing's too), of
        *version*: a changed file's pages and handle are dropped in the
        background."""
        if self._stale(ino, version):
            nursery.start_soon(self.changed, ino)

    async def changed(self, ino: int) -> None:
        """*ino* changed since its pages were read; no open will tell the
        kernel (``keep_cache``): drop them (in a thread: the kernel waits for
        any page under a READ, which this loop answers) and the handle with
        its old layout."""
        await self.drop(ino)
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino)
        except OSError as exc:
            log.debug("invalidate_inode(%d): %s", ino, exc)

    async def sweep(self) -> None:
        """Give back the handles no READ used for ``linger``, forever."""
        every = min(max(self.linger / 4, SWEEP_MIN), SWEEP_MAX)
        while True:
            await trio.sleep(every)
            now = trio.current_time()
            idle = [ino for ino, (_, last) in self.handles.items() if now - last >= self.linger]
            for ino in idle:
                await self.drop(ino)
