"""Prefetch hints sent by getxattr, taken in libfuse's callback.

A read-only mount takes batches of hints as getxattrs of the mount root
whose names carry the paths (``user.shufflefs.prefetch/PATHS``,
fuse/prefetch_xattr.py). Through pyfuse3 each such request waited for a turn
of its loop: pyfuse3 reads one request per pass of the trio scheduler
(one worker waits for the device at a time), and during a cold epoch every
pass also runs the prefetcher's fetches. Measured on this project's 2-core
VMs (four hinted readers of 8,000 cold 110 KB files): the handler took
0.1 ms, and the reader's getxattr 58 ms; hints reached the mount up to
0.7 s after they were sent, later than the reads of 3% of the files,
which then read from the disk themselves.

Here the GETXATTR's trampoline (fuse/read_inode.py) hands a hint to a task
of its own at once and the request counts as taken, so the drain of the
kernel's queue (fuse/libfuse.py, `KernelQueue`) goes on to the requests
behind it in the same pass. The task resolves and queues the hints as
pyfuse3's handler would (`hint_named`) and then replies: the getxattr
still returns once its hints are queued, with the same value and errnos.
Every other getxattr goes on as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging

import pyfuse3

from shufflefs.fuse.fast_answers import CallbackAnswers
from shufflefs.fuse.prefetch_hints import QUEUED
from shufflefs.fuse.prefetch_xattr import NAMED_PREFIX, hint_named
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.fuse")


class FastHints(CallbackAnswers):
    def install(self) -> None:
        self.hooks.fast_hint = self.getxattr

    def close(self) -> None:
        """Take no more requests (before the FUSE session closes)."""
        self.hooks.fast_hint = None

    def getxattr(self, req: int, ino: int, name: int, size: int) -> bool:
        """Take a GETXATTR that carries hints (True), or leave it (False,
        nothing done): only the named form on the mount root, asked with
        room for the answer (a size probe, size 0, goes the usual way)."""
        if ino != pyfuse3.ROOT_INODE or size < len(QUEUED):  # (`HELD` is shorter)
            return False
        value = ctypes.string_at(name)
        if not value.startswith(NAMED_PREFIX):
            return False
        self.counts.hint += 1
        self.ops.prefetch.hint_arrived()
        self.nursery.start_soon(self._hint, req, ino, value)
        self.queue.answered(True)
        return True

    async def _hint(self, req: int, ino: int, name: bytes) -> None:
        try:
            value = await hint_named(self.ops, ino, name)
        except FsError as exc:
            log.info("prefetch hint refused: %s", exc.message)
            self.libfuse.reply_err(req, exc.code)
        except Exception:
            log.exception("prefetch hint of %r failed", name[:80])
            self.libfuse.reply_err(req, errno.EIO)
        else:
            self.libfuse.reply_buf(req, value, len(value))
