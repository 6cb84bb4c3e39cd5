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
* the store never blocks the event loop: the kernel locks each page it
  fills, and a page locked by a READ waits for this process's event loop to
  answer it. The notifications are written to the FUSE device through the
  loop's io_uring, by the kernel's io-wq workers (`UringReads.write_many`);
  without io_uring, by a worker thread through pyfuse3.
* a file that changed through this mount while its bytes were stored
  (a write, a truncate) has its pages dropped again afterwards.

Why not pyfuse3's ``notify_store`` in a thread (as before): each call
hands the GIL back and takes it again, and the thread must first be
started and get the GIL from a loop busy with a cold epoch; measured on
this project's 2-core VMs, a batch's store took 11 ms on average (starting
the thread 8 ms p50, 40 ms mean), longer than reading it. Through the ring,
four hinted readers' p90 open+read+close was 150-320 µs against 670-1,530
µs (more files stored before their reader came), their throughput even.

What it costs: stored pages are page cache, which the kernel reclaims
under memory pressure like any other file's; the mount's ``prefetch_memory``
bounds only the bytes it holds itself. How far ahead of the reads the
stored bytes run is the loader's lookahead (the hints it sends), at most
``MAX_PENDING`` hinted ranges.
"""

from __future__ import annotations

import errno
import functools
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Protocol

import pyfuse3
import trio

from shufflefs.fuse.libfuse import LibFuse
from shufflefs.fuse.prefetch_hints import Version
from shufflefs.fuse.read_inode import READ_INODES
from shufflefs.storage.uring import UringReads, for_this_run

log = logging.getLogger("shufflefs.fuse.page_store")

PIECE = 1 << 20  # bytes per notification (one write to /dev/fuse each)
FUSE_NOTIFY_STORE = 4  # linux/fuse.h: enum fuse_notify_code
# struct fuse_out_header (len, error: the notification's code, unique: 0),
# then struct fuse_notify_store_out (nodeid, offset, size, padding)
STORE_HEADER = struct.Struct("<IiQQQII")

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
        done = await self._store_all(todo, skip)
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

    async def _store_all(self, files: list[Fetched], skip: Callable[[int], bool]) -> set[int]:
        """The inodes of *files* whose bytes the kernel took (skipping those
        *skip* names as they come)."""
        device = _device_fd()
        ring = for_this_run() if device is not None else None
        if device is None or ring is None:
            return await trio.to_thread.run_sync(self._store_in_thread, files, skip)
        return await self._store_through(ring, device, files, skip)

    async def _store_through(
        self, ring: UringReads, device: int, files: list[Fetched], skip: Callable[[int], bool]
    ) -> set[int]:
        owners: list[int] = []
        writes: list[tuple[int, list[bytearray]]] = []
        for ino, _, chunks in files:
            if skip(ino):
                continue
            for offset, piece in pieces(chunks):
                writes.append((device, [store_message(ino, offset, piece)]))
                owners.append(ino)
        failed = set()
        for ino, result in zip(owners, await ring.write_many(writes), strict=True):
            if isinstance(result, OSError):
                failed.add(ino)
                self._failed(ino, result)
        return set(owners) - failed

    def _failed(self, ino: int, exc: OSError) -> None:
        if exc.errno == errno.ENOSYS:
            if self.enabled:
                log.warning("the kernel takes no stored pages (notify_store: ENOSYS)")
            self.enabled = False
        elif exc.errno != errno.ENOENT:  # ENOENT: the kernel forgot the inode
            log.debug("notify_store(%d): %s", ino, exc)

    def _store_in_thread(self, files: list[Fetched], skip: Callable[[int], bool]) -> set[int]:
        done = set()
        for ino, _, chunks in files:
            if skip(ino):
                continue
            try:
                for offset, piece in pieces(chunks):
                    pyfuse3.notify_store(ino, offset, piece)  # type: ignore[arg-type]  # (any buffer)
            except OSError as exc:
                self._failed(ino, exc)
                if not self.enabled:
                    break
                continue
            done.add(ino)
        return done


def pieces(chunks: list[tuple[int, memoryview]]) -> Iterator[tuple[int, memoryview]]:
    """A file's fetched *chunks* cut into notifications of up to PIECE bytes:
    (offset, bytes) each (an empty chunk: one empty piece)."""
    for off, data in chunks:
        for at in range(0, max(len(data), 1), PIECE):
            yield off + at, data[at : at + PIECE]


def store_message(ino: int, offset: int, data: memoryview) -> bytearray:
    """A FUSE_NOTIFY_STORE message of *data*, of *ino* at *offset* (what
    libfuse's ``fuse_lowlevel_notify_store`` writes). One buffer of its own,
    not a view of the batch's: the io_uring binding's ``Iovec`` keeps a
    memoryview's buffer exported for good (the batch's memory would never
    be freed), a bytearray's it does not."""
    size = len(data)
    total = STORE_HEADER.size + size
    message = bytearray(STORE_HEADER.pack(total, FUSE_NOTIFY_STORE, 0, ino, offset, size, 0))
    message += data  # (grown, not zeroed first and then overwritten)
    return message


def _device_fd() -> int | None:
    """The FUSE device of this process's session, once the READ hook found
    the session (fuse/read_inode.py); else None."""
    session = READ_INODES.session
    return _session_fd(session) if session else None


@functools.cache
def _session_fd(session: int) -> int:
    return int(LibFuse().session_fd(session))


def invalidate_pages(ino: int) -> None:
    """Drop the kernel's pages (and attributes) of *ino*; in a thread (the
    kernel waits for any page under a READ, which the event loop answers)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=False)
    except OSError as exc:
        log.debug("invalidate_inode(%d): %s", ino, exc)
