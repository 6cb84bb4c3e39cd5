"""Group flushes (storage/group_sync.py): updates that arrive together share
a flush, and none is acknowledged before the flush that covers it. The
syscalls are replaced by functions that record their order."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from shufflefs.rpc.errors import FsError
from shufflefs.storage.group_sync import FileFlush, FileSync
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

CS = 1 << 16


class Recorder:
    """Records events in order; the first file sync holds its batch until
    *hold* more requests are queued behind it, so the next batch is
    deterministic."""

    def __init__(self, hold: int = 0, fail_fd: int | None = None, fail_dir: str | None = None):
        self.events: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.hold = hold
        self.fail_fd = fail_fd
        self.fail_dir = fail_dir
        self.sync: FileSync | None = None

    def note(self, kind: str, what: object) -> None:
        with self.lock:
            self.events.append((kind, what))

    def sync_file(self, fd: int, new: bool) -> None:
        if self.hold and self.sync is not None:
            deadline = time.monotonic() + 10
            while len(self.sync.runner._pending) < self.hold:
                assert time.monotonic() < deadline, "the other writers never queued"
                time.sleep(0.005)
            self.hold = 0
        self.note("sync", fd)
        if fd == self.fail_fd:
            raise OSError(errno.EIO, "injected")

    def sync_dir(self, path: str) -> None:
        self.note("dir", path)
        if path == self.fail_dir:
            raise OSError(errno.EIO, "injected")

    def index(self, kind: str, what: object) -> int:
        return self.events.index((kind, what))


def run_writers(rec: Recorder, sync: FileSync, n: int) -> dict[int, BaseException]:
    errors: dict[int, BaseException] = {}

    def writer(fd: int) -> None:
        rec.note("write", fd)
        try:
            sync.flush(FileFlush(fd, True, f"d{fd % 2}"))
        except OSError as exc:
            errors[fd] = exc
            return
        rec.note("ack", fd)

    first = threading.Thread(target=writer, args=(0,))
    first.start()
    deadline = time.monotonic() + 10
    while sync.runner.batches == 0 and not sync.runner._busy:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    others = [threading.Thread(target=writer, args=(fd,)) for fd in range(1, n)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(20)
        assert not t.is_alive()
    return errors


def test_writes_arriving_together_share_one_flush_and_wait_for_it() -> None:
    n = 9
    rec = Recorder(hold=n - 1)
    sync = FileSync(rec.sync_file, rec.sync_dir)
    rec.sync = sync
    assert run_writers(rec, sync, n) == {}
    # the first writer's batch, then one batch for the 8 that queued meanwhile
    assert (sync.runner.batches, sync.runner.items) == (2, n)
    for fd in range(n):
        write, flushed, ack = rec.index("write", fd), rec.index("sync", fd), rec.index("ack", fd)
        assert write < flushed < ack
        # the directory naming the new file is durable before the ack too
        dirs = [i for i, e in enumerate(rec.events) if e == ("dir", f"d{fd % 2}")]
        assert any(flushed < i < ack for i in dirs)
    # the second batch fsynced each of its two directories once, not once per file
    assert sum(1 for e in rec.events if e[0] == "dir") == 1 + 2


def test_a_failed_flush_fails_only_the_writes_it_covers() -> None:
    n = 7
    rec = Recorder(hold=n - 1, fail_fd=3, fail_dir="d0")
    sync = FileSync(rec.sync_file, rec.sync_dir)
    rec.sync = sync
    errors = run_writers(rec, sync, n)
    # fd 3 failed its own sync; the even fds share the failed directory d0
    assert sorted(errors) == [0, 2, 3, 4, 6]
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors.values())
    assert [fd for kind, fd in rec.events if kind == "ack"] and {
        fd for kind, fd in rec.events if kind == "ack"
    } == {1, 5}


def test_a_staged_update_is_committed_only_after_its_flush(tmp_path: Path) -> None:
    """A store's deferred flush (stage with flush=False, as the chain does
    while forwarding) is done before the record commit, whether the caller
    flushes explicitly or leaves it to the commit."""
    store = ChunkStore(tmp_path / "t", block_size=512, fsync=True, reserve_bytes=0)
    events: list[str] = []
    real_commit = store._commit_batch

    def sync_file(fd: int, new: bool) -> None:
        (os.fsync if new else os.fdatasync)(fd)
        events.append("flush")

    def commit_batch(changes: list) -> list:  # type: ignore[type-arg]
        events.append("commit")
        return real_commit(changes)

    store._file_sync = FileSync(sync_file)
    store._commit_batch = commit_batch  # type: ignore[method-assign]
    store._record_commits._process = commit_batch
    try:
        a, b = chunk_id(1, 0), chunk_id(2, 0)
        staged = store.stage_write(a, 0, b"x" * 1000, CS, None, False)
        assert events == [] and staged.unflushed is not None
        assert store.read(a, 0, CS) == b""  # invisible until committed
        store.flush(staged)
        assert events == ["flush"]
        store.commit(staged)
        assert events == ["flush", "commit"]
        staged = store.stage_write(b, 0, b"y" * 700, CS, None, False)
        store.commit(staged)  # flushes first
        assert events == ["flush", "commit", "flush", "commit"]
        staged = store.stage_write(a, 1000, b"z" * 10, CS, None, False)  # an append
        store.abort(staged)
        assert events[-1] == "commit" and len(events) == 4  # nothing flushed or committed
        assert store.read(a, 0, CS) == b"x" * 1000 and store.read(b, 0, CS) == b"y" * 700
    finally:
        store.close()
    reopened = ChunkStore(tmp_path / "t", block_size=512, fsync=True, reserve_bytes=0)
    try:
        assert reopened.read(a, 0, CS) == b"x" * 1000
        assert (reopened.used, reopened.chunks) == (1700, 2)
    finally:
        reopened.close()


def test_concurrent_commits_of_many_chunks_all_land(tmp_path: Path) -> None:
    """Record commits of many threads (grouped into shared transactions)
    each land, with the counters right after a reopen."""
    store = ChunkStore(tmp_path / "t", block_size=512, fsync=True, reserve_bytes=0)
    n = 24
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            store.write(chunk_id(i + 1, 0), 0, CS, bytes([i]) * (100 + i))
        except FsError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert errors == []
    assert store._record_commits.items == n and store._file_sync.runner.items == n
    store.close()
    reopened = ChunkStore(tmp_path / "t", block_size=512, fsync=True, reserve_bytes=0)
    try:
        for i in range(n):
            assert reopened.read(chunk_id(i + 1, 0), 0, CS) == bytes([i]) * (100 + i)
        assert (reopened.used, reopened.chunks) == (sum(100 + i for i in range(n)), n)
    finally:
        reopened.close()


def test_whole_batch_failure_reaches_every_waiter() -> None:
    from shufflefs.storage.group_sync import GroupRunner

    def process(items: list[int]) -> list[BaseException | None]:
        raise FsError(errno.ENOSPC, "full")

    runner: GroupRunner[int] = GroupRunner(process)
    with pytest.raises(FsError) as info:
        runner.run(1)
    assert info.value.errno == errno.ENOSPC
