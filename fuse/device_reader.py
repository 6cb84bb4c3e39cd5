"""Which of pyfuse3's worker tasks waits for the FUSE device, without a
hand-over per request.

pyfuse3's workers take turns at the device under a fair `trio.Lock`: the
worker that receives a request releases the lock, which wakes the next
worker at once, and that one takes the lock and waits for the device in
the next turn of trio's loop. A request answered in libfuse's callback (the
fast paths: fuse/fast_reads.py, fuse/fast_answers.py; most requests of a
mount serving samples) is over before that turn, and the worker that took
it would be back at the device right away: the hand-over was a turn of the
loop (an `epoll_wait`, the scheduler, an `epoll_ctl` of the device's
registration) for nothing. At one fio job of 4 KiB reads through a storage
daemon every READ paid it, two turns of the loop where one does.

Here (pyfuse3's `_wait_fuse_readable`, replaced) the worker that received a
request keeps the device: back from a request answered in the callback, it
waits for the next one itself, and the other workers stay parked. Only a
request whose handler may wait (a coroutine of `ShuffleOps`: metadata
calls, reads on the loop) hands the device over, from the handler's start
(`hand_over`, in `fuse_errors` and `forget`). A parked worker also looks
every `PARK_CHECK` seconds whether the device has no one waiting at it and
the session still runs, and takes it then: a handler that waits without
having handed over delays other requests that long at most, never for
good. When the session ends (`pyfuse3.terminate`, or an unmount: the
device then reports an error), every worker ends at once.

pyfuse3 starts a new worker whenever it finds none idle at the device by
its own count, which this replacement does not keep, so it grows to its
``max_tasks`` workers (the mount option) and keeps them: parked, they cost
memory only.
"""

from __future__ import annotations

import select
from collections.abc import Callable

import pyfuse3
import trio

from shufflefs.fuse.libfuse import LibFuse

PARK_CHECK = 1.0  # s between a parked worker's looks at the device
_PYFUSE3_WAIT = pyfuse3._wait_fuse_readable  # type: ignore[attr-defined]


class DeviceReader:
    """The one worker waiting at the FUSE device *fd* (see the module
    docstring); *exited*: whether the FUSE session has ended. Used on the
    loop's thread only."""

    def __init__(self, fd: int, exited: Callable[[], bool]) -> None:
        self._fd = fd
        self._exited = exited
        self._reader: trio.lowlevel.Task | None = None
        self._parked = trio.lowlevel.ParkingLot()
        self._ended = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    async def wait_readable(self) -> bool:
        """pyfuse3's `_wait_fuse_readable`: True once a request waits at the
        device for this worker; False when the worker should end."""
        while self._reader is not None:
            with trio.move_on_after(PARK_CHECK):
                await self._parked.park()
            if self._ended:
                return False
        if self._ended or self._exited():
            self._end()
            return False
        self._reader = trio.lowlevel.current_task()
        try:
            await trio.lowlevel.wait_readable(self._fd)
        except trio.ClosedResourceError:  # pyfuse3.terminate: the session is closing
            self._end()
            return False
        finally:
            self._reader = None
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in self._poll.poll(0)):
            self._end()  # unmounted: this worker's receive ends it, the parked ones end now
        return True

    def hand_over(self) -> None:
        """A handler that may wait begins: if no worker waits at the device,
        one of the parked ones takes it (in the loop's next turn)."""
        if self._reader is None:
            self._parked.unpark()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._parked.unpark_all()


_current: DeviceReader | None = None


def install(session: int) -> None:
    """Wait at the device of libfuse's *session* this way from now on (the
    mount, once pyfuse3's session exists): pyfuse3's worker loop looks its
    wait up by name on every call."""
    global _current
    libfuse = LibFuse()
    _current = DeviceReader(
        libfuse.session_fd(session), lambda: bool(libfuse.session_exited(session))
    )
    pyfuse3._wait_fuse_readable = _current.wait_readable  # type: ignore[attr-defined]


def hand_over() -> None:
    """(a handler of `ShuffleOps` begins) See `DeviceReader.hand_over`;
    nothing where none is installed."""
    if _current is not None:
        _current.hand_over()


def uninstall() -> None:
    """(the mount's session is over) pyfuse3's own wait again."""
    global _current
    pyfuse3._wait_fuse_readable = _PYFUSE3_WAIT  # type: ignore[attr-defined]
    _current = None
