"""Keep the C heap's freed pages in the process (glibc malloc tuning).

Every read a shufflefs process serves or makes allocates its buffer anew: a
`bytearray` for the bytes of a range, a `bytes` copy for their checksum.
Python hands buffers of more than 512 bytes to the C allocator. With glibc's
defaults a buffer of 128 KiB or more is either mapped for itself or, once the
dynamic threshold has risen, taken from the heap, whose top is given back to
the kernel as soon as more than twice that threshold is free there. Either
way the next buffer of the same size faults its pages in again, and the
kernel zeroes every one of them: for 128 KiB reads through a storage daemon
that was about a third of the daemon's CPU (page faults, `clear_page`,
unmapping; `perf`, docs/storage.md).

Fixed thresholds stop both: buffers up to `MMAP_THRESHOLD` come from the heap,
and up to `TRIM_THRESHOLD` of free heap top stays mapped for the next one. The
cost is that a process's resident size stays near its peak instead of
shrinking after a burst; the peak itself is bounded by the requests in flight.

The services and the mount set them at start (`run_service`); the native
`Client` sets them for the process it is made in (a loader's worker), whose
batched reads allocate a result buffer per call: 64 random 4 KiB reads through
the daemons faulted in 36 pages a call without them (tests/e2e/test_native_client.py),
and one reader's batched 4 KiB reads ran 1.2-1.7x as fast with them, eight readers' 1.1x.

`uninitialized` hands out a buffer without the zero-fill ``bytearray(n)``
does, for the buffers a read overwrites whole before anyone looks at them
(a chunk file's range read with ``preadv``, a frame's payload received,
the native client's result of a batched read, whose item past a chunk's
end is zero-filled by the code that places it). The fill is a pass over
memory the read then writes again: for 128 KiB reads through the daemons,
`perf` put ``memset`` at 11% of a native reader's CPU (an 8 MiB result per
batch of 64) and 4% of a daemon's. Buffers that leave a process whole
before every byte is known to be written (the mount's READ replies, which
another user's process receives) keep the zeros.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("shufflefs.heap")

_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize  # (NULL, n): not filled
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_new_bytearray.restype = ctypes.py_object

UNINITIALIZED_MIN = 32 << 10  # smaller buffers: the ctypes call costs more than the fill
M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 128 << 20


def keep_freed_pages() -> bool:
    """Set the thresholds (see the module docstring); False where the C
    library is not glibc (nothing is changed then)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except AttributeError:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.info("mallopt refused the heap thresholds; the allocator's defaults stay")
    return ok


def uninitialized(n: int) -> bytearray:
    """``bytearray(n)`` without the zero-fill (from `UNINITIALIZED_MIN` bytes
    on): only for a buffer every byte of which is written before it is read
    or sent (see the module docstring)."""
    if n < UNINITIALIZED_MIN:
        return bytearray(n)
    buf: bytearray = _new_bytearray(None, n)
    return buf
