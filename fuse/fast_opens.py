"""OPENs and RELEASEs answered in libfuse's callback, before pyfuse3 sees them.

A warm sample read through a read-write or ``-o ro`` mount costs the mount
two upcalls, its OPEN and its RELEASE (the kernel answers the READs from
its page cache), and neither needs a round trip when the client's open
cache answers it (client/open_cache.py). Handled as pyfuse3 handles any
request, each still cost a task of its own on the trio loop: pyfuse3's
callback, its coroutine, our handler, the reply; measured on a
``-o ro`` mount read warm by four processes, that machinery was five times
the handlers' own work and the mount's one core the limit.

So the trampolines in front of pyfuse3's ``open`` and ``release`` callbacks
(fuse/read_inode.py) offer each request here first, on the loop's thread,
inside libfuse's dispatch. `ShuffleOps.open_now` and
`ShuffleOps.release_now` answer it exactly as the handlers would when that
takes no wait (a read-only open the open cache trusts; the release of such
a file with nothing to flush and no handle to give back): the same
bookkeeping, then ``fuse_reply_open`` / ``fuse_reply_err(0)``. Anything
else (a miss, a revalidation, a write open, a dropped entry's last close)
is declined and goes through pyfuse3 as before. The file info's handle is
read and written at `FH_OFFSET` only once that offset was confirmed
against pyfuse3's own reading (`ReadInodes.confirm`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyfuse3
import trio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from shufflefs.fuse.libfuse import KernelQueue
from shufflefs.fuse.read_inode import BITS_OFFSET, DIRECT_IO_BIT, FH_OFFSET, KEEP_CACHE_BIT

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps
    from shufflefs.fuse.read_inode import ReadInodes

log = logging.getLogger("shufflefs.fuse.fast_opens")


@dataclass
class FastOpenCounts:
    """Requests answered here (counted on the loop's thread, exported when scraped)."""

    opens: int = 0
    releases: int = 0

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "shufflefs_client_fast_opens",
            "OPENs and RELEASEs a mount answered in libfuse's callback (fuse/fast_opens.py)",
            labels=["op"],
        )
        family.add_metric(["open"], self.opens)
        family.add_metric(["release"], self.releases)
        yield family


class FastOpens:
    def __init__(
        self,
        ops: ShuffleOps,
        hooks: ReadInodes,
        nursery: trio.Nursery,
        queue: KernelQueue,
        counts: FastOpenCounts,
    ) -> None:
        self.ops = ops
        self.nursery = nursery
        self.hooks = hooks
        self.queue = queue
        self.libfuse = queue.libfuse
        self.counts = counts
        self._warned = False

    def install(self) -> None:
        self.hooks.fast_open = self.open
        self.hooks.fast_release = self.release

    def close(self) -> None:
        """Take no more requests (before the FUSE session closes)."""
        self.hooks.fast_open = None
        self.hooks.fast_release = None

    def open(self, req: int, ino: int, fi: int) -> bool:
        """Answer an OPEN (True) or decline it (nothing done)."""
        flags = ctypes.c_int.from_address(fi).value
        try:
            info = self.ops.open_now(ino, flags)
        except Exception:
            self._warn("OPEN", ino)
            self.queue.answered(False)
            return False
        if info is None:
            self.queue.answered(False)
            return False
        bits = ctypes.c_uint32.from_address(fi + BITS_OFFSET)
        bits.value |= (KEEP_CACHE_BIT if info.keep_cache else 0) | (
            DIRECT_IO_BIT if info.direct_io else 0
        )
        ctypes.c_uint64.from_address(fi + FH_OFFSET).value = info.fh
        ret = self.libfuse.reply_open(req, fi)
        if ret:
            # the opener was interrupted meanwhile: the kernel will send no
            # RELEASE for a handle it never got
            log.debug("fuse_reply_open: %s", errno.errorcode.get(-ret, ret))
            if not self.ops.release_now(info.fh):
                self.nursery.start_soon(self._give_back, info.fh)
        self.counts.opens += 1
        self.queue.answered(True)
        return True

    def release(self, req: int, ino: int, fi: int) -> bool:
        """Answer a RELEASE (True) or decline it (nothing done)."""
        fh = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
        try:
            if not self.ops.release_now(fh):
                self.queue.answered(False)
                return False
        except Exception:
            self._warn("RELEASE", ino)
            self.queue.answered(False)
            return False
        self.libfuse.reply_err(req, 0)
        self.counts.releases += 1
        self.queue.answered(True)
        return True

    async def _give_back(self, fh: int) -> None:
        with contextlib.suppress(pyfuse3.FUSEError):
            await self.ops.release(fh)

    def _warn(self, what: str, ino: int) -> None:
        if not self._warned:
            self._warned = True
            log.exception("fast %s of inode %d failed: it goes the usual way", what, ino)
