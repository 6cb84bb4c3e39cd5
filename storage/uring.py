"""Disk reads through io_uring, completed on the trio event loop.

A read that must wait for the disk used to cost a worker-thread round trip:
the thread's wake-up, the GIL handed back and forth, and trio's wake-up of
the loop (a socketpair write) when it is done. On these VMs that is about
200 µs of CPU per read, four times the read itself (docs/storage.md, "Cold
reads through io_uring"). Here the loop submits the read to a ring and goes
on; the kernel completes it (ext4 reads buffered pages asynchronously, no
kernel thread in between) and signals an eventfd, and one task of the loop
(`_reap`, a trio system task) wakes for every completion that arrived
meanwhile.

A read may name a file to open first (`open_and_read`): the open runs in
the ring too (the kernel's io-wq workers wait for the directory lookup and
the inode, not this thread), and the reaper submits the file's read as soon
as its open is done. Measured on this project's VMs, one thread keeping 64
such opens-then-reads of cold 110 KB chunk files in flight read 10,691
files/s, as many as 16 threads of blocking `open` + `pread` (10,507), and
twice what a round of opens followed by a round of reads did (5,383).

`UringReads.open()` is None where io_uring cannot be used (the `liburing`
binding missing, the kernel too old, or io_uring disabled:
``kernel.io_uring_disabled``, a seccomp filter): callers then read in
threads as before. One instance per trio run (`for_this_run`): a ring
belongs to the loop that reaps it. A thread that may block has its own ring
(storage/uring_threads.py).

A read cannot be taken back once submitted: the kernel may write into the
buffer until its completion arrives. So a waiting task is shielded from
cancellation until then (as `trio.to_thread.run_sync` waits for its thread),
and the buffer stays referenced by the ring's table of reads in flight.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger("shufflefs.storage.uring")

ENTRIES = 256  # submission queue size: reads in flight per ring
# reads waiting at once from which a busy loop has the kernel's workers copy
# them (`UringReads.submit`'s *offload*)
OFFLOAD_AT = 3

try:  # an optional fast path: without it, reads use threads
    import liburing as _uring  # type: ignore[import-untyped]  # stubs, no py.typed
except ImportError:  # pragma: no cover - the binding is a dependency
    _uring = None


def open_how(writable: bool, cloexec: bool) -> Any:
    """The ``open_how`` of an open in the ring: read-only or read-write."""
    how = _uring.OpenHow()
    how.flags = (os.O_RDWR if writable else os.O_RDONLY) | (os.O_CLOEXEC if cloexec else 0)
    return how


# a read of `open_and_read`: (fd, or a path to open; buffer; offset), and its
# outcome: (the fd, or the open's error; bytes read, or the error)
FileRead = tuple[int | str, bytearray, int]
FileOutcome = tuple[int | OSError, int | OSError]
# a write of `write_many`: (fd, the buffers written in order, as one writev)
Write = tuple[int, list[Any]]


@dataclass(eq=False)
class _Batch:
    """Reads submitted together (`open_and_read`); their waiter wakes once
    all are done (or, submitted by `submit`, their callback is called)."""

    # referenced until the completions: the kernel writes into the buffers
    # and reads the paths (a write's: (fd, its iovec, 0))
    requests: list[tuple[int | str, Any, int]]
    # per request: the fd (a path's once opened; -1 while it is opening) or
    # the open's error
    fds: list[int | OSError]
    results: list[int | OSError]
    remaining: int
    done: trio.Event = field(default_factory=trio.Event)
    then: Callable[[list[FileOutcome]], None] | None = None
    offload: bool = False  # its reads go to the kernel's io-wq workers (`submit`)
    writable: bool = False  # its paths are opened read-write

    def outcomes(self) -> list[FileOutcome]:
        return list(zip(self.fds, self.results, strict=True))


@dataclass(eq=False)
class _Chain:
    """A file's open linked to its read and to the install of a regular fd
    for it (`UringReads._prep_chain`): request *k* of *batch*, in a slot of
    the ring's file table until its read and install are in."""

    batch: _Batch
    k: int
    slot: int
    idents: tuple[int, int, int]  # the open's, the read's, the install's
    read: int | OSError | None = None
    fd: int | OSError | None = None


class UringReads:
    """Reads (``pread``) submitted to one io_uring of this trio run."""

    def __init__(self, ring: Any, eventfd: int) -> None:
        self._ring = ring
        self._eventfd = eventfd
        self._cqe: Any = _uring.Cqe()
        self._in_flight: dict[int, tuple[_Batch, int]] = {}
        self._next_id = 1
        self._room = trio.Semaphore(ENTRIES)
        self._how = {w: open_how(w, cloexec=True) for w in (False, True)}
        self._followed = 0  # next steps submitted by `follow` in this pass of the reaper
        # free slots of the ring's file table (`open`: none where the kernel
        # has no direct descriptors), and the linked opens using the others
        self._slots: list[int] = []
        self._chains: dict[int, _Chain] = {}
        # (a direct descriptor takes no O_CLOEXEC; its install sets it)
        self._direct_how = {w: open_how(w, cloexec=False) for w in (False, True)}
        self._empty_slot = _uring.FileIndex([-1])
        self.reads = 0  # completed (tests, debugging)
        self.opens = 0
        self.offloaded = 0  # reads submitted to io-wq workers (`submit`'s *offload*)

    @classmethod
    def open(cls) -> UringReads | None:
        """A ring with its eventfd, or None where io_uring cannot be used."""
        ring = _new_ring()
        if ring is None:
            return None
        try:
            eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            _uring.io_uring_register_eventfd(ring, eventfd)
        except OSError as exc:
            _uring.io_uring_queue_exit(ring)
            log.info("io_uring eventfd refused (%s): disk reads use threads", exc)
            return None
        reads = cls(ring, eventfd)
        try:
            _uring.io_uring_register_files_sparse(ring, ENTRIES)
            reads._slots = list(range(ENTRIES))
        except OSError as exc:  # (a kernel before 5.19) opens are followed by the reaper
            log.info("io_uring file table refused (%s): opens then reads", exc)
        return reads

    @property
    def opens_linked(self) -> bool:
        """Whether an open and its read go in one submission (`_prep_chain`)."""
        return bool(self._slots or self._chains)

    async def open_and_read(
        self, requests: list[FileRead], offload: bool = False, writable: bool = False
    ) -> list[FileOutcome]:
        """Each (fd, or the path of a file to open read-only; buffer;
        offset) read into its buffer, a path opened first and its read
        submitted by the reaper as soon as the open is done (no round of
        opens before a round of reads: one slow open holds up only its own
        read). All in flight together, as many as the ring takes, and waited
        for together. Per request: the fd (a path's is the caller's to close)
        or the open's error; the bytes read or the read's error (the open's,
        when it failed). Opening a file that is not open yet waits for the
        disk (its directory entry, its inode): here the kernel's workers wait,
        not this thread. *offload*: as `submit`'s. *writable*: paths are
        opened read-write (else read-only)."""
        batch = self._batch(list(requests), extra=1, offload=offload)
        batch.writable = writable
        await self._submit_all(batch, self._prep_file)
        return batch.outcomes()

    async def write_many(self, requests: list[Write]) -> list[int | OSError]:
        """Each (fd, buffers) written as one ``writev``, all in flight
        together and waited for together: the bytes written or the error.
        The writes go to the kernel's io-wq workers at once (IOSQE_ASYNC,
        never tried on this thread): a write that must wait (a FUSE device's
        ``notify_store``, for a page a READ holds locked until this loop
        answers it) makes a kernel worker wait, not this thread, and no
        Python thread or GIL hand-off is involved (fuse/page_store.py).
        Buffers must be bytes or bytearrays: the binding's ``Iovec`` keeps
        a memoryview's buffer exported for good (its memory never freed)."""
        writes: list[tuple[int | str, Any, int]] = [
            (fd, _uring.Iovec(buffers), 0) for fd, buffers in requests
        ]
        batch = _Batch(writes, [fd for fd, _ in requests], [0] * len(requests), 1)
        await self._submit_all(batch, self._prep_write)
        return batch.results

    async def _submit_all(self, batch: _Batch, prep: Callable[[_Batch, int], None]) -> None:
        """Each request of *batch* prepared by *prep* and submitted, as the
        ring has room; back once all are done (shielded: the kernel owns the
        buffers until then)."""
        unsubmitted = 0
        try:
            for k in range(len(batch.requests)):
                try:
                    self._room.acquire_nowait()
                except trio.WouldBlock:
                    if unsubmitted:
                        _uring.io_uring_submit(self._ring)
                        unsubmitted = 0
                    with trio.CancelScope(shield=True):  # what was submitted must finish
                        await self._room.acquire()
                prep(batch, k)
                unsubmitted += 1
        finally:
            if unsubmitted:
                _uring.io_uring_submit(self._ring)
            batch.remaining -= 1
            if batch.remaining == 0:
                batch.done.set()
            with trio.CancelScope(shield=True):  # the kernel owns the buffers until done
                await batch.done.wait()

    def submit(
        self,
        requests: list[FileRead],
        then: Callable[[list[FileOutcome]], None],
        offload: bool = False,
    ) -> bool:
        """`open_and_read` without waiting (code on the loop that cannot
        await: the mount's READ callbacks): *then* is called with the
        outcomes, on the loop, once all are done. False (nothing submitted)
        if the ring has no room for them all now. The buffers must stay
        untouched until then.

        With *offload* the reads go to the kernel's io-wq workers
        (IOSQE_ASYNC) instead of being tried on this thread first. A
        buffered read of pages not in the page cache is otherwise finished
        by this thread: the kernel copies the bytes into the buffer as task
        work the next time the thread enters it, so a loop that waits on many
        cold reads at once spends its own time copying them (a fifth of the
        mount's, reading cold 110 KB samples from eight processes, `perf`).
        A worker copies on another core instead; the price is its wake-up,
        which a lone read pays in latency, so callers offload only when the
        loop is the one that is busy (fuse/fast_reads.py)."""
        if not requests or self._room.value < len(requests):
            return False
        batch = self._batch(list(requests), extra=0, offload=offload)
        batch.then = then
        for k in range(len(requests)):
            self._room.acquire_nowait()
            self._prep_file(batch, k)
        _uring.io_uring_submit(self._ring)
        return True

    def _batch(
        self, requests: list[tuple[int | str, Any, int]], extra: int, offload: bool
    ) -> _Batch:
        """The batch of `open_and_read` (its count of *extra* holds it open
        while it is submitted)."""
        fds: list[int | OSError] = [r[0] if isinstance(r[0], int) else -1 for r in requests]
        return _Batch(requests, fds, [0] * len(requests), extra, offload=offload)

    def _follow(self, batch: _Batch, ident: int, k: int, result: int | OSError) -> bool:
        """A completion of request *k* of *batch*, before it counts: True if
        it was an open whose read is now submitted under the same *ident*
        (and slot of the ring) instead."""
        if batch.fds[k] != -1 or not isinstance(batch.requests[k][0], str):
            return False
        self.opens += 1
        batch.fds[k] = result
        if isinstance(result, OSError):
            return False  # the read's outcome is the open's error
        _, buf, offset = batch.requests[k]
        sqe = self._prep_read(batch, result, buf, offset)
        sqe.user_data = ident
        self._in_flight[ident] = (batch, k)
        self._followed += 1
        return True

    def _prep_file(self, batch: _Batch, k: int) -> None:
        """The first step of request *k* of *batch* (its open, or its read
        of an open fd), in the submission queue; a slot of the ring taken."""
        what, buf, offset = batch.requests[k]
        if isinstance(what, str):
            if self._slots:
                self._prep_chain(batch, k, what, buf, offset)
                return
            sqe = _uring.io_uring_get_sqe(self._ring)
            _uring.io_uring_prep_openat2(sqe, what, self._how[batch.writable])
        else:
            sqe = self._prep_read(batch, what, buf, offset)
        self._track(sqe, batch, k)

    def _prep_chain(self, batch: _Batch, k: int, path: str, buf: Any, offset: int) -> None:
        """Request *k* of *batch* as one chain of three linked steps: the
        open into a slot of the ring's file table (its completion posted
        only if it fails, and then the chain ends there), the read from
        that slot, and the install of a regular fd for the file, which runs
        whatever the read got (a hard link). No trip through the reaper
        between the open and the read: that trip cost four readers of cold
        samples 5-12% when an open was followed by its read (`_follow`). The
        slot is emptied once the read and the install are in."""
        if _uring.io_uring_sq_space_left(self._ring) < 3:  # (a chain is never split)
            _uring.io_uring_submit(self._ring)
        slot = self._slots.pop()
        first = self._next_id
        self._next_id += 3
        chain = _Chain(batch, k, slot, (first, first + 1, first + 2))
        opening = _uring.io_uring_get_sqe(self._ring)
        how = self._direct_how[batch.writable]
        _uring.io_uring_prep_openat2_direct(opening, path, how, slot)
        _uring.io_uring_sqe_set_flags(opening, _uring.IOSQE_IO_LINK | _uring.IOSQE_CQE_SKIP_SUCCESS)
        reading = _uring.io_uring_get_sqe(self._ring)
        _uring.io_uring_prep_read(reading, slot, buf, offset)
        flags = _uring.IOSQE_FIXED_FILE | _uring.IOSQE_IO_HARDLINK
        if batch.offload:
            flags |= _uring.IOSQE_ASYNC
            self.offloaded += 1
        _uring.io_uring_sqe_set_flags(reading, flags)
        installing = _uring.io_uring_get_sqe(self._ring)
        _uring.io_uring_prep_fixed_fd_install(installing, slot)
        _uring.io_uring_sqe_set_flags(installing, _uring.IOSQE_FIXED_FILE)
        for sqe, ident in zip((opening, reading, installing), chain.idents, strict=True):
            sqe.user_data = ident
            self._chains[ident] = chain
        batch.remaining += 1

    def _chain_step(self, chain: _Chain, ident: int, result: int | OSError) -> bool:
        """A completion of *chain*: True once the request is done (its
        read's and its install's are in, or its open failed)."""
        opened, read, installed = chain.idents
        if ident == opened:  # only a failure is posted; the other steps never run
            error = result if isinstance(result, OSError) else OSError(errno.EIO, "open")
            chain.read = chain.fd = error
            self._chains.pop(read, None)
            self._chains.pop(installed, None)
        elif ident == read:
            chain.read = result
        else:
            chain.fd = result
        if chain.read is None or chain.fd is None:
            return False
        self._chains.pop(opened, None)  # (its success is not posted)
        # the slot lets its file go (the caller has its own fd): a chunk
        # file removed meanwhile frees its space
        try:
            _uring.io_uring_register_files_update(self._ring, self._empty_slot, chain.slot)
            self._slots.append(chain.slot)
        except OSError as exc:  # (never seen) the slot is lost, never the reaper
            log.warning("io_uring slot %d not emptied (%s): no longer used", chain.slot, exc)
        self.opens += 1
        chain.batch.fds[chain.k] = chain.fd
        return True

    def _prep_read(self, batch: _Batch, fd: int, buf: Any, offset: int) -> Any:
        """A read of *batch* in the submission queue (for an io-wq worker
        if the batch is offloaded); its sqe."""
        sqe = _uring.io_uring_get_sqe(self._ring)
        _uring.io_uring_prep_read(sqe, fd, buf, offset)
        if batch.offload:
            _uring.io_uring_sqe_set_flags(sqe, _uring.IOSQE_ASYNC)
            self.offloaded += 1
        return sqe

    def _prep_write(self, batch: _Batch, k: int) -> None:
        """Write *k* of *batch* in the submission queue, for an io-wq worker."""
        fd, iovec, _ = batch.requests[k]
        sqe = _uring.io_uring_get_sqe(self._ring)
        _uring.io_uring_prep_writev(sqe, fd, iovec)
        _uring.io_uring_sqe_set_flags(sqe, _uring.IOSQE_ASYNC)
        self._track(sqe, batch, k)

    def _track(self, sqe: Any, batch: _Batch, k: int) -> None:
        """*sqe* is request *k* of *batch*: its completion finds it."""
        sqe.user_data = ident = self._next_id
        self._next_id += 1
        self._in_flight[ident] = (batch, k)
        batch.remaining += 1

    async def _reap(self) -> None:
        """Wake for completions, hand each to its batch; at the end of the
        run (trio cancels its system tasks once every other task is done,
        so no read is in flight), close the ring."""
        cqe = self._cqe
        try:
            while True:
                await trio.lowlevel.wait_readable(self._eventfd)
                with contextlib.suppress(BlockingIOError):  # another wake-up took it
                    os.eventfd_read(self._eventfd)
                seen = 0
                completions = _uring.io_uring_cqe_iter_init(self._ring)
                while _uring.io_uring_cqe_iter_next(completions, cqe):
                    entry = cqe[0]
                    seen += 1
                    ident = entry.user_data
                    chain = self._chains.pop(ident, None)
                    found = None if chain is not None else self._in_flight.pop(ident, None)
                    if chain is None and found is None:
                        continue
                    try:
                        result: int | OSError = entry.res  # the binding raises for a negative one
                    except OSError as exc:
                        result = exc
                    if chain is not None:
                        if not self._chain_step(chain, ident, result):
                            continue
                        assert chain.read is not None
                        batch, k, result = chain.batch, chain.k, chain.read
                    else:
                        assert found is not None
                        batch, k = found
                        if self._follow(batch, ident, k, result):
                            continue  # its next step is in flight, in the same slot
                    batch.results[k] = result
                    self.reads += 1
                    self._room.release()
                    batch.remaining -= 1
                    if batch.remaining == 0:
                        batch.done.set()
                        if batch.then is not None:
                            _call(batch.then, batch.outcomes())
                if seen:
                    _uring.io_uring_cq_advance(self._ring, seen)
                if self._followed:
                    self._followed = 0
                    _uring.io_uring_submit(self._ring)
        finally:
            _uring.io_uring_queue_exit(self._ring)
            os.close(self._eventfd)


def _call(then: Callable[[list[FileOutcome]], None], results: list[FileOutcome]) -> None:
    """A `submit` callback: its failure is its caller's bug, never the reaper's end."""
    try:
        then(results)
    except Exception:
        log.exception("a callback of reads through io_uring failed")


def _new_ring() -> Any | None:
    """An initialized ring, or None where io_uring cannot be used (logged)."""
    if _uring is None or os.environ.get("SHUFFLEFS_NO_URING"):
        return None
    ring = _uring.Ring()
    try:
        _uring.io_uring_queue_init(ENTRIES, ring, 0)
    except OSError as exc:
        log.info("io_uring unavailable (%s): disk reads use threads", exc)
        return None
    return ring


def available() -> bool:
    """Whether io_uring can be used here (a ring opens)."""
    ring = _new_ring()
    if ring is None:
        return False
    _uring.io_uring_queue_exit(ring)
    return True


_RUN_LOCAL: trio.lowlevel.RunVar[UringReads | None] = trio.lowlevel.RunVar("shufflefs_uring")


def for_this_run() -> UringReads | None:
    """This trio run's ring (opened, and its reaper started, on first use),
    or None without io_uring."""
    try:
        return _RUN_LOCAL.get()
    except LookupError:
        reads = UringReads.open()
        _RUN_LOCAL.set(reads)
        if reads is not None:
            trio.lowlevel.spawn_system_task(reads._reap, name="shufflefs io_uring reaper")
        return reads
