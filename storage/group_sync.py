"""Group flushes: the updates that reach a target together share its disk
flushes instead of paying them one after the other.

A flush (fsync, or LMDB's durable commit) costs a device cache flush, about
the same for one file as for sixteen; writes of many clients (many small
files) queue behind each other's flushes on one target. So each of the two
durable steps of an update (docs/storage.md, "Group flushes") goes through
a `GroupRunner`: the bytes of staged updates (`FileSync`: every file's
fsync, then one fsync per directory holding new files) and the record
commits (`storage/staging.py`: many records in one LMDB transaction).

`GroupRunner.run` is called from the worker threads that do an update's
disk work and returns only when a batch that *started after* the call has
finished: what the caller wrote before calling is covered. Leader/follower,
no thread of its own: a caller that finds no batch running takes every
queued request (up to ``max_batch``) and processes them; callers arriving
meanwhile queue for the next batch, which one of them leads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import fsync_dir

T = TypeVar("T")

MAX_BATCH = 256
SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int], None] | None:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` (Linux; not in
    `os`): starts the writeback of a file's dirty pages without waiting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start_writeback(fd: int) -> None:
        call(fd, 0, 0, SYNC_FILE_RANGE_WRITE)  # best effort: the fsync reports errors

    return start_writeback


start_writeback = _load_sync_file_range()


@dataclass(eq=False)
class _Request(Generic[T]):
    item: T
    done: bool = False
    error: BaseException | None = None


class GroupRunner(Generic[T]):
    """Runs ``process(items)`` over the requests of many threads, batched.

    *process* returns one outcome per item (None: done; an exception: that
    item failed) or raises (every item of the batch failed)."""

    def __init__(
        self,
        process: Callable[[list[T]], Sequence[BaseException | None]],
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._process = process
        self.max_batch = max(1, max_batch)
        self._cond = threading.Condition()
        self._pending: list[_Request[T]] = []
        self._busy = False
        self.batches = 0  # batches processed (tests, stats)
        self.items = 0  # items processed

    def run(self, item: T) -> None:
        """Queue *item*; return once a batch holding it was processed (raise
        its error if it failed)."""
        (error,) = self.run_many([item])
        if error is not None:
            raise error

    def run_many(self, items: Sequence[T]) -> list[BaseException | None]:
        """Queue *items* together; return once batches holding every one of
        them were processed: per item None or its error (a fresh `FsError`
        per caller, as tracebacks are not shared)."""
        reqs = [_Request(item) for item in items]
        with self._cond:
            self._pending.extend(reqs)
            while not all(req.done for req in reqs):
                if self._busy:
                    self._cond.wait()
                    continue
                self._lead()
        return [_fresh(req.error) for req in reqs]

    def _lead(self) -> None:
        """Process the next batch (called with the condition held; released
        while the batch runs)."""
        batch = self._pending[: self.max_batch]
        del self._pending[: self.max_batch]
        self._busy = True
        self._cond.release()
        outcomes: Sequence[BaseException | None]
        try:
            try:
                outcomes = self._process([r.item for r in batch])
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"{len(outcomes)} outcomes for {len(batch)} items")
            except BaseException as exc:  # the whole batch failed
                outcomes = [exc] * len(batch)
        finally:
            self._cond.acquire()
            for req, outcome in zip(batch, outcomes, strict=True):
                req.error = outcome
                req.done = True
            self.batches += 1
            self.items += len(batch)
            self._busy = False
            self._cond.notify_all()


def _fresh(exc: BaseException | None) -> BaseException | None:
    if isinstance(exc, FsError):
        return FsError(exc.code, exc.message)
    return exc


@dataclass(frozen=True)
class FileFlush:
    """A staged update's bytes to make durable: *fd* (fsync if *new*, as the
    file's size and allocation changed, else fdatasync) and, for a new file,
    the directory *directory* that names it."""

    fd: int
    new: bool
    directory: str | None = None


def _sync_file(fd: int, new: bool) -> None:
    if new:
        os.fsync(fd)
    else:
        os.fdatasync(fd)


class FileSync:
    """The data flush of one target: ``flush(FileFlush)`` returns once the
    file's bytes (and, for a new file, its directory entry) are durable.
    A batch starts every file's writeback, syncs every file once, then
    every directory once: the
    directory fsyncs, the costly part of creating many small chunk files,
    are shared by every new file of the batch in that directory.
    *sync_file* and *sync_dir* are the syscalls (tests record their order)."""

    def __init__(
        self,
        sync_file: Callable[[int, bool], None] = _sync_file,
        sync_dir: Callable[[str], None] = fsync_dir,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._sync_file = sync_file
        self._sync_dir = sync_dir
        self.runner: GroupRunner[FileFlush] = GroupRunner(self._flush_batch, max_batch)

    def flush(self, item: FileFlush) -> None:
        self.runner.run(item)

    def flush_many(self, items: Sequence[FileFlush]) -> list[BaseException | None]:
        """`flush` of several files at once (their outcomes, not raised)."""
        return self.runner.run_many(items)

    def _flush_batch(self, items: list[FileFlush]) -> list[BaseException | None]:
        if len(items) > 1 and start_writeback is not None and self._sync_file is _sync_file:
            # every file's writeback under way first: the fsyncs then find
            # their pages written (and, on ext4, allocated in one journal
            # transaction) instead of each starting its own, one by one
            for item in items:
                start_writeback(item.fd)
        outcomes: list[BaseException | None] = []
        for item in items:
            try:
                self._sync_file(item.fd, item.new)
                outcomes.append(None)
            except OSError as exc:
                outcomes.append(exc)
        dirs: dict[str, OSError | None] = {}
        for item, outcome in zip(items, outcomes, strict=True):
            if item.directory is None or outcome is not None or item.directory in dirs:
                continue
            try:
                self._sync_dir(item.directory)
                dirs[item.directory] = None
            except OSError as exc:
                dirs[item.directory] = exc
        return [
            outcome if outcome is not None or item.directory is None else dirs[item.directory]
            for item, outcome in zip(items, outcomes, strict=True)
        ]
