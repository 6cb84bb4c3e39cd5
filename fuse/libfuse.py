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
at most one, as pyfuse3 keeps one coroutine per turn. A request libfuse
answers itself in the dispatch (IOCTL: pyfuse3 has none) leaves no handler
to await, so the drain goes on past it.

Once the queue is empty, the loop's thread keeps polling it for a moment
(`spin`: the mount option ``spin_us``) before it goes back to pyfuse3's
loop and sleeps: a reader that opens, reads from the page cache and closes
one sample after another sends its next request within microseconds, and a
request that finds the thread awake costs neither side a wake-up (measured
on this project's 2-core VMs: a wake-up across cores is 45-95 µs, on the
same core 8 µs). It does not spin while a READ it handed on (to a storage
node, or a disk-wait thread) is unanswered: that reader sends nothing
before its answer, and the thread answering it wants the GIL.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import select
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric

from shufflefs.cluster.metrics_client import counts_family

log = logging.getLogger("shufflefs.fuse.libfuse")

LIBFUSE = "libfuse3.so"
DRAIN_MAX = 64  # requests taken from the kernel's queue per answered one, at most
SPIN = 50e-6  # s the queue is polled for once empty, before sleeping (mount option spin_us)
# requests libfuse answers in its dispatch, with no handler of pyfuse3's:
# IOCTL (ENOSYS: pyfuse3 has no ioctl; Python's buffered open() asks every
# file whether it is a terminal). A drain goes on past them.
FUSE_IOCTL = 39
ANSWERED_BY_LIBFUSE = frozenset({FUSE_IOCTL})
FUSE_BUF_IS_FD = 1 << 1  # fuse_common.h: the request is in a pipe, not in memory
OPCODE_OFFSET = 4  # struct fuse_in_header: len (u32), opcode (u32), unique (u64), ...
IN_HEADER_SIZE = 40
SPIN_BUDGET = 2e-3  # s of draining and polling per answered request, at most


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
        self.reply_write = _bind(free.fuse_reply_write, c_int, void, ctypes.c_size_t)
        self.session_fd = _bind(held.fuse_session_fd, c_int, void)
        self.session_exited = _bind(held.fuse_session_exited, c_int, void)
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


class FuseBufvec(ctypes.Structure):
    """libfuse's ``struct fuse_bufvec`` with its one buffer (what a WRITE
    hands ``write_buf``: count 1, idx 0)."""

    _fields_ = (
        ("count", ctypes.c_size_t),
        ("idx", ctypes.c_size_t),
        ("off", ctypes.c_size_t),
        ("buf", FuseBuf),
    )


FUSE_BUF_IS_FD = 1 << 1  # the bytes are in a pipe (splice), not in memory


@dataclass
class SpinCounts:
    """How the loop thread's polls of the empty queue ended (counted on that
    thread, exported when scraped)."""

    caught: int = 0  # a request came: answered with no wake-up
    idle: int = 0  # none came within spin_us: back to pyfuse3's loop, to sleep

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_fuse_spins",
            "Polls of a mount's empty FUSE queue (spin_us) by how they ended",
            "outcome",
            self,
        )


class KernelQueue:
    """The FUSE session's request queue, drained after a fast answer (see
    the module docstring). Used on the loop's thread only."""

    def __init__(self, session: int, spin: float = SPIN, spins: SpinCounts | None = None) -> None:
        self.libfuse = LibFuse()
        self.spin = spin
        self.session = session
        self._poll = select.poll()
        self._poll.register(self.libfuse.session_fd(session), select.POLLIN)
        self._buf = FuseBuf()  # libfuse allocates its memory on the first receive
        self._draining = False
        self._took = False
        # run once a drain is over (fast READs send what they planned meanwhile)
        self.after_drain: list[Callable[[], None]] = []
        # True while something answered elsewhere is awaited (then no spin)
        self.busy: list[Callable[[], bool]] = []
        self.spins = spins or SpinCounts()
        self.on_inline: Callable[[], None] | None = None  # a drain took one libfuse answered

    def answered(self, took: bool) -> None:
        """A fast path was offered a request and *took* it (answered it, now
        or later) or not. Within a drain that decides whether it goes on;
        outside, a request taken drains the queue behind it."""
        if self._draining:
            self._took = took
            return
        if not took:
            return
        # pyfuse3's loop (and every task on it) waits while we go on: back to
        # it within SPIN_BUDGET (or one spin) however fast requests come
        until = time.perf_counter() + max(SPIN_BUDGET, self.spin)
        while True:
            try:
                emptied = self._drain()
            except Exception:  # (what was dispatched is answered, each on its own way)
                log.exception("taking the requests waiting behind one failed")
                return
            for then in self.after_drain:
                then()
            if not emptied or not self.spin or any(busy() for busy in self.busy):
                return
            if not self._wait_briefly(until):
                return

    def empty(self) -> bool:
        """Whether no request waits in the kernel's queue right now."""
        return not self._poll.poll(0)

    def _wait_briefly(self, until: float) -> bool:
        """Poll the empty queue for up to `spin` seconds (not past *until*):
        True if a request came."""
        poll = self._poll.poll
        clock = time.perf_counter
        end = min(clock() + self.spin, until)
        while clock() < end:
            if poll(0):
                self.spins.caught += 1
                return True
        self.spins.idle += 1
        return False

    def _drain(self) -> bool:
        """Take the waiting requests while a fast path (or libfuse itself)
        answers each; True if it stopped at an empty queue."""
        self._draining = True
        try:
            for _ in range(DRAIN_MAX):
                if not self._poll.poll(0):
                    return True
                self._took = False
                if self.libfuse.receive_buf(self.session, ctypes.byref(self._buf)) <= 0:
                    return False
                self.libfuse.process_buf(self.session, ctypes.byref(self._buf))
                if self._took:
                    continue
                if self._opcode() not in ANSWERED_BY_LIBFUSE:
                    return False
                if self.on_inline is not None:
                    self.on_inline()
            return False
        finally:
            self._draining = False

    def _opcode(self) -> int:
        """The opcode of the request last received (its fuse_in_header, still
        in the buffer after the dispatch), or 0 if it did not land in memory."""
        buf = self._buf
        if buf.flags & FUSE_BUF_IS_FD or not buf.mem or buf.size < IN_HEADER_SIZE:
            return 0
        return ctypes.c_uint32.from_address(buf.mem + OPCODE_OFFSET).value

    def close(self) -> None:
        """Free what libfuse allocated for the receives (the session is closing)."""
        if self._buf.mem:
            ctypes.CDLL(None).free(ctypes.c_void_p(self._buf.mem))
            self._buf.mem = None
