"""io_uring for a thread that may block: a thread channel's I/O thread
(rpc/channel.py), where the storage daemon serves the reads that the
mount's fast path and the native client send and that must wait for the disk.

The same reads as `UringReads` (storage/uring.py, the trio loop's ring),
submitted together and waited for in ``io_uring_enter`` by the calling
thread. A read may name a file to open first (`open_and_read`): its open
runs in the ring (the kernel's io-wq workers wait for the directory entry
and the inode), and its read is submitted as soon as the open is in, so the
opens and reads of one request's cold files all wait for the disk together,
in one thread. Without it such a request took the files one after the other
(open, then read) in each of several threads, a hand-off to each.
One ring per thread (`for_this_thread`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

from shufflefs.storage.uring import (
    ENTRIES,
    FileOutcome,
    FileRead,
    _new_ring,
    _uring,
    open_how,
)

OPEN, READ = 0, 1  # the step a completion's user_data names (its low bit)


class BlockingUringReads:
    """Reads (and the opens before them) through this thread's ring."""

    def __init__(self, ring: Any) -> None:
        self._ring = ring
        self._cqe: Any = _uring.Cqe()
        self.reads = 0  # completed (tests, debugging)
        self.opens = 0
        self._how = {w: open_how(w, cloexec=True) for w in (False, True)}
        # the ring goes with its thread's locals (a channel's thread ends with its connection)
        weakref.finalize(self, _uring.io_uring_queue_exit, ring)

    def open_and_read(self, requests: list[FileRead], writable: bool = False) -> list[FileOutcome]:
        """As `UringReads.open_and_read` (a path's fd is the caller's to
        close; *writable*: opened read-write), blocking this thread until
        every request is done. At most a ring's worth in flight; the next
        request goes in as one finishes."""
        how = self._how[writable]
        fds: list[int | OSError] = [r[0] if isinstance(r[0], int) else -1 for r in requests]
        results: list[int | OSError] = [0] * len(requests)
        ring, cqe = self._ring, self._cqe
        queued = 0  # requests whose first step is in the ring
        in_flight = 0
        while queued < len(requests) or in_flight:
            while queued < len(requests) and in_flight < ENTRIES:
                what, buf, offset = requests[queued]
                sqe = _uring.io_uring_get_sqe(ring)
                if isinstance(what, str):
                    _uring.io_uring_prep_openat2(sqe, what, how)
                    sqe.user_data = queued << 1 | OPEN
                else:
                    _uring.io_uring_prep_read(sqe, what, buf, offset)
                    sqe.user_data = queued << 1 | READ
                queued += 1
                in_flight += 1
            _uring.io_uring_submit(ring)
            with contextlib.suppress(OSError):  # a failed step's cqe: read below
                _uring.io_uring_wait_cqe(ring, cqe)
            seen = followed = 0
            completions = _uring.io_uring_cqe_iter_init(ring)
            while _uring.io_uring_cqe_iter_next(completions, cqe):
                entry = cqe[0]
                seen += 1
                k, step = entry.user_data >> 1, entry.user_data & 1
                try:
                    result: int | OSError = entry.res  # the binding raises for a negative one
                except OSError as exc:
                    result = exc
                if step == OPEN:
                    self.opens += 1
                    fds[k] = result
                    if not isinstance(result, OSError):  # its read, in the same place
                        _, buf, offset = requests[k]
                        sqe = _uring.io_uring_get_sqe(ring)
                        _uring.io_uring_prep_read(sqe, result, buf, offset)
                        sqe.user_data = k << 1 | READ
                        followed += 1
                        continue
                else:
                    self.reads += 1
                results[k] = result  # (a failed open: the read's outcome is its error)
                in_flight -= 1
            if seen:
                _uring.io_uring_cq_advance(ring, seen)
            if followed:
                _uring.io_uring_submit(ring)
        return list(zip(fds, results, strict=True))


_THREAD_LOCAL = threading.local()


def for_this_thread() -> BlockingUringReads | None:
    """This thread's ring (opened on first use; closed with the thread's
    locals), or None without io_uring."""
    if hasattr(_THREAD_LOCAL, "reads"):
        found: BlockingUringReads | None = _THREAD_LOCAL.reads
        return found
    ring = _new_ring()
    reads = None if ring is None else BlockingUringReads(ring)
    _THREAD_LOCAL.reads = reads
    return reads
