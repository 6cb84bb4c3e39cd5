"""libfuse, called directly: replies from any thread, and the kernel's queue
of requests taken in libfuse's callback.

pyfuse3 reads one request per turn of its loop: a worker task takes the
read lock, waits for the device to be readable, receives the request,
dispatches it (libfuse calls the operation's callback, which creates the
handler's coroutine), and awaits that coroutine. A request the fast paths
answer in the callback (fuse/fast_reads.py, fuse/fast_answers.py) needs none
of that but the receive and the dispatch, so once one has answered one,
`KernelQueue` receives and dispatches the requests already waiting behind
it right there, as pyfuse3 would, for as long as a fast path answers each:
one turn of pyfuse3's loop for many requests (for READs, which it batches
per storage node, +60% at 8 fio jobs). The first request no fast path
answers is dispatched too, and pyfuse3's loop awaits its handler as usual:
at most one, as pyfuse3 keeps one coroutine per turn.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import select
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shufflefs.fuse.libfuse")

LIBFUSE = "libfuse3.so"
DRAIN_MAX = 64  # requests taken from the kernel's queue per answered one, at most


class LibFuse:
    """The calls made here into the libfuse that pyfuse3 loaded (the one that
    owns the session and its requests). Replies are made without the GIL
    (any thread may make them); receiving and dispatching a request keep it,
    as pyfuse3's loop does: the dispatch runs pyfuse3's callbacks, which
    need it."""

    def __init__(self) -> None:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if LIBFUSE in line}
        if len(paths) != 1:
            raise OSError(errno.ENOENT, f"expected one {LIBFUSE} in this process, found {paths}")
        path = paths.pop()
        free = ctypes.CDLL(path)  # calls that release the GIL
        held = ctypes.PyDLL(path)  # calls that keep it
        void, ptr, c_int = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int
        buf = ctypes.POINTER(FuseBuf)
        self.reply_buf = _bind(free.fuse_reply_buf, c_int, void, ptr, ctypes.c_size_t)
        self.reply_open = _bind(free.fuse_reply_open, c_int, void, ptr)
        self.reply_entry = _bind(free.fuse_reply_entry, c_int, void, ptr)
        self.reply_attr = _bind(free.fuse_reply_attr, c_int, void, ptr, ctypes.c_double)
        self.reply_err = _bind(free.fuse_reply_err, c_int, void, c_int)
        self.session_fd = _bind(held.fuse_session_fd, c_int, void)
        self.receive_buf = _bind(held.fuse_session_receive_buf, c_int, void, buf)
        self.process_buf = _bind(held.fuse_session_process_buf, None, void, buf)


def _bind(function: Any, restype: Any, *argtypes: Any) -> Any:
    """*function* of a loaded library, with its C signature."""
    function.argtypes = argtypes
    function.restype = restype
    return function


class FuseBuf(ctypes.Structure):
    """libfuse's ``struct fuse_buf`` (fuse_common.h)."""

    _fields_ = (
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    )


class KernelQueue:
    """The FUSE session's request queue, drained after a fast answer (see
    the module docstring). Used on the loop's thread only."""

    def __init__(self, session: int) -> None:
        self.libfuse = LibFuse()
        self.session = session
        self._poll = select.poll()
        self._poll.register(self.libfuse.session_fd(session), select.POLLIN)
        self._buf = FuseBuf()  # libfuse allocates its memory on the first receive
        self._draining = False
        self._took = False
        # run once a drain is over (fast READs send what they planned meanwhile)
        self.after_drain: list[Callable[[], None]] = []

    def answered(self, took: bool) -> None:
        """A fast path was offered a request and *took* it (answered it, now
        or later) or not. Within a drain that decides whether it goes on;
        outside, a request taken drains the queue behind it."""
        if self._draining:
            self._took = took
            return
        if not took:
            return
        try:
            self._drain()
        except Exception:  # (what was dispatched is answered, each on its own way)
            log.exception("taking the requests waiting behind one failed")
        for then in self.after_drain:
            then()

    def _drain(self) -> None:
        self._draining = True
        try:
            for _ in range(DRAIN_MAX):
                if not self._poll.poll(0):
                    return
                self._took = False
                if self.libfuse.receive_buf(self.session, ctypes.byref(self._buf)) <= 0:
                    return
                self.libfuse.process_buf(self.session, ctypes.byref(self._buf))
                if not self._took:
                    return
        finally:
            self._draining = False

    def close(self) -> None:
        """Free what libfuse allocated for the receives (the session is closing)."""
        if self._buf.mem:
            ctypes.CDLL(None).free(ctypes.c_void_p(self._buf.mem))
            self._buf.mem = None
