"""A target's update queue (storage/update_queue.py): the steps of updates
that arrive while a batch is in its worker thread go together in the next
one; each still gets its own outcome, and every update lands whole or not
at all. The first batch is held in its thread until the others queued
behind it, so the batches are known."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import REGISTRY

from shufflefs.rpc.errors import FsError
from shufflefs.storage.group_sync import FileSync, GroupRunner
from shufflefs.storage.protocol import NEED_FULL, WriteResult, chunk_id
from shufflefs.storage.staging import Staged
from shufflefs.storage.store import ChunkStore
from shufflefs.storage.update_queue import UpdateQueue

CS = 1 << 16


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore(tmp_path / "t", block_size=512, fsync=True, reserve_bytes=0)
    yield s
    s.close()


def chunk_files(store: ChunkStore) -> list[str]:
    """The names of the chunk files on disk (`<chunk id hex>.<generation>`)."""
    return sorted(name for _, _, files in os.walk(store.path / "chunks") for name in files)


class HeldFirstBatch:
    """A worker-thread call whose first batch waits (in the thread's place)
    until *behind* more steps are queued, so that they form the next one."""

    def __init__(self, behind: int) -> None:
        self.behind = behind
        self.queue: UpdateQueue | None = None

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.behind and self.queue is not None:
            with trio.fail_after(10):
                while len(self.queue._pending) < self.behind:
                    await trio.sleep(0.001)
            self.behind = 0
        return await trio.to_thread.run_sync(fn, *args)


def held_queue(store: ChunkStore, behind: int) -> UpdateQueue:
    run = HeldFirstBatch(behind)
    queue = run.queue = UpdateQueue(store, run)
    return queue


def stage(store: ChunkStore, cid: bytes, offset: int, data: bytes) -> Callable[[], Staged]:
    return partial(store.stage_write, cid, offset, data, CS, None, False)


def fail_flushes_of(store: ChunkStore, cid: bytes) -> None:
    """Every flush of chunk *cid*'s files fails (EIO) from now on."""

    def sync_file(fd: int, new: bool) -> None:
        if cid.hex() in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "injected")
        (os.fsync if new else os.fdatasync)(fd)

    store._file_sync = FileSync(sync_file)


async def run_all(calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Start *calls* in order (each queued before the next starts)."""
    outcomes: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        try:
            outcomes[i] = await calls[i]()
        except FsError as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()  # it has queued its step
    return outcomes


def test_steps_arriving_during_a_batch_share_the_next(store: ChunkStore) -> None:
    n = 8
    queue = held_queue(store, n - 1)
    cids = [chunk_id(i + 1, 0) for i in range(n)]

    async def main() -> list[Any]:
        return await run_all(
            [
                partial(queue.write, cid, stage(store, cid, 0, bytes([i]) * (300 + i)))
                for i, cid in enumerate(cids)
            ]
        )

    observed = REGISTRY.get_sample_value("shufflefs_storage_update_batch_size_sum") or 0.0
    results = trio.run(main)
    assert results == [{"version": 1, "length": 300 + i} for i in range(n)]
    assert (queue.batches, queue.steps) == (2, n)
    assert REGISTRY.get_sample_value("shufflefs_storage_update_batch_size_sum") == observed + n
    # the second batch: one flush pass and one record transaction for its 7
    assert store._file_sync.runner.batches == 2 and store._record_commits.batches == 2
    for i, cid in enumerate(cids):
        assert store.read(cid, 0, CS) == bytes([i]) * (300 + i)
    assert (store.used, store.chunks) == (sum(300 + i for i in range(n)), n)


def test_a_failed_step_fails_only_its_update(store: ChunkStore) -> None:
    """In one batch: a stage refused (a version that does not follow), a
    write whose flush fails, and writes that land; the failed write leaves
    nothing, neither record nor file."""
    good, refused, unflushable = chunk_id(1, 0), chunk_id(2, 0), chunk_id(3, 0)
    store.write(refused, 0, CS, b"r" * 100)
    fail_flushes_of(store, unflushable)
    queue = held_queue(store, 3)
    first = chunk_id(4, 0)

    async def main() -> list[Any]:
        return await run_all(
            [
                partial(queue.write, first, stage(store, first, 0, b"f" * 10)),
                partial(
                    queue.write,
                    refused,
                    partial(store.stage_write, refused, 100, b"x", CS, 5, False),
                ),
                partial(queue.write, unflushable, stage(store, unflushable, 0, b"u" * 50)),
                partial(queue.write, good, stage(store, good, 0, b"g" * 70)),
            ]
        )

    results = trio.run(main)
    assert results[0] == {"version": 1, "length": 10}
    assert isinstance(results[1], FsError) and results[1].code == NEED_FULL
    assert isinstance(results[2], FsError) and results[2].code == errno.EIO
    assert results[3] == {"version": 1, "length": 70}
    assert queue.batches == 2
    assert store.committed(unflushable) is None
    assert store.read(refused, 0, CS) == b"r" * 100 and store.read(good, 0, CS) == b"g" * 70
    files = " ".join(chunk_files(store))
    assert unflushable.hex() not in files and good.hex() in files


def test_two_steps_of_one_chunk_never_share_a_batch(store: ChunkStore) -> None:
    """Two writes of one chunk queued together: the second is staged on the
    first's committed record, in a batch of its own."""
    cid, other = chunk_id(1, 0), chunk_id(2, 0)
    queue = held_queue(store, 3)

    async def main() -> list[Any]:
        return await run_all(
            [
                partial(queue.write, other, stage(store, other, 0, b"o" * 10)),
                partial(queue.write, cid, stage(store, cid, 0, b"a" * 100)),
                partial(queue.write, cid, partial(store.stage_write, cid, 100, b"b" * 20, CS)),
                partial(queue.write, other, stage(store, other, 10, b"p" * 5)),
            ]
        )

    results = trio.run(main)
    assert results[1] == {"version": 1, "length": 100}
    assert results[2] == {"version": 2, "length": 120}
    assert results[3] == {"version": 2, "length": 15}
    assert queue.batches == 3
    assert store.read(cid, 0, CS) == b"a" * 100 + b"b" * 20
    assert store.read(other, 0, CS) == b"o" * 10 + b"p" * 5


def test_stage_flush_commit_as_the_chain_takes_them(store: ChunkStore) -> None:
    """A replica's steps (stage and flush while forwarding, then commit):
    invisible until the commit, durable after."""
    cid = chunk_id(7, 0)
    queue = held_queue(store, 0)

    async def main() -> WriteResult:
        staged = await queue.stage_durably(cid, stage(store, cid, 0, b"z" * 900))
        assert staged.unflushed is None and store.read(cid, 0, CS) == b""
        return await queue.commit(staged)

    assert trio.run(main) == {"version": 1, "length": 900}
    path = store.path
    store.close()
    reopened = ChunkStore(path, block_size=512, fsync=True, reserve_bytes=0)
    try:
        assert reopened.read(cid, 0, CS) == b"z" * 900
    finally:
        reopened.close()


def test_a_staged_update_whose_flush_fails_is_aborted_in_its_step(store: ChunkStore) -> None:
    """`stage_durably` (a replica's stage and flush while it forwards): a
    flush that fails leaves nothing (its caller never holds the update to
    abort it), and the other updates of the batch are returned staged and
    durable."""
    good, unflushable = chunk_id(1, 0), chunk_id(2, 0)
    fail_flushes_of(store, unflushable)
    queue = held_queue(store, 2)
    first = chunk_id(3, 0)

    async def main() -> list[Any]:
        return await run_all(
            [
                partial(queue.write, first, stage(store, first, 0, b"f" * 10)),
                partial(queue.stage_durably, unflushable, stage(store, unflushable, 0, b"u" * 50)),
                partial(queue.stage_durably, good, stage(store, good, 0, b"g" * 70)),
            ]
        )

    results = trio.run(main)
    assert isinstance(results[1], FsError) and results[1].code == errno.EIO
    staged = results[2]
    assert isinstance(staged, Staged) and staged.unflushed is None
    assert queue.batches == 2
    assert store.committed(unflushable) is None
    assert unflushable.hex() not in " ".join(chunk_files(store))
    assert trio.run(queue.commit, staged) == {"version": 1, "length": 70}
    assert store.read(good, 0, CS) == b"g" * 70


def test_a_cancelled_caller_still_sees_its_update_through(store: ChunkStore) -> None:
    """A step handed on runs to its end even if its caller is cancelled
    meanwhile (else a staged update would be left behind, nobody's)."""
    cid, other = chunk_id(1, 0), chunk_id(2, 0)
    queue = held_queue(store, 1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.write, other, stage(store, other, 0, b"o" * 10))
            await trio.testing.wait_all_tasks_blocked()  # its batch is held
            with trio.move_on_after(0.005):
                await queue.write(cid, stage(store, cid, 0, b"c" * 30))

    trio.run(main)
    assert store.read(cid, 0, CS) == b"c" * 30 and store.read(other, 0, CS) == b"o" * 10
    assert queue._pending == [] and not queue._busy


def test_commit_many_refuses_two_updates_of_one_chunk(store: ChunkStore) -> None:
    cid = chunk_id(1, 0)
    a = store.stage_write(cid, 0, b"a" * 10, CS, None, False)
    b = store.stage_write(cid, 0, b"b" * 10, CS, None, False)
    with pytest.raises(FsError) as err:
        store.commit_many([a, b])
    assert err.value.code == errno.EINVAL
    assert store.committed(cid) is None and not a.done and not b.done
    store.abort(a)
    store.abort(b)
    assert chunk_files(store) == []


def test_group_runner_run_many_gives_each_item_its_outcome() -> None:
    def process(items: list[int]) -> list[BaseException | None]:
        return [FsError(errno.EIO, f"item {i}") if i % 2 else None for i in items]

    runner: GroupRunner[int] = GroupRunner(process, max_batch=3)
    outcomes = runner.run_many(list(range(7)))
    assert [o is None for o in outcomes] == [i % 2 == 0 for i in range(7)]
    failed = {i: o.message for i, o in enumerate(outcomes) if isinstance(o, FsError)}
    assert failed == {i: f"item {i}" for i in (1, 3, 5)}
    assert (runner.batches, runner.items) == (3, 7)


def test_run_many_carries_a_batch_in_one_call_and_never_strands_the_queue(
    store: ChunkStore,
) -> None:
    """`run_many` (a batch of writes): its steps share thread calls (two
    here: at most three a call), each gets its own outcome; a thread call
    that fails as a whole fails the steps it carried, the steps it did not
    carry leave the queue, and the queue serves the next caller."""
    from shufflefs.storage.update_queue import Step, Then

    calls: list[int] = []

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        calls.append(len(args[1]))
        if fail:
            raise RuntimeError("injected: the thread call failed")
        return await trio.to_thread.run_sync(fn, *args)

    queue = UpdateQueue(store, run, max_batch=3)
    cids = [chunk_id(100 + i, 0) for i in range(5)]

    def steps() -> list[Step]:
        return [
            Step(cid, Then.COMMIT, stage=stage(store, cid, 0, bytes([i]) * 100))
            for i, cid in enumerate(cids)
        ]

    fail = False
    ok = steps()
    trio.run(queue.run_many, ok)
    assert calls == [3, 2]
    assert [s.result() for s in ok] == [{"version": 1, "length": 100}] * 5

    fail, calls[:] = True, []
    failing = steps()
    with pytest.raises(RuntimeError):
        trio.run(queue.run_many, failing)
    assert calls == [3]
    assert all(s.finished for s in failing[:3]) and not any(s.finished for s in failing[3:])
    assert queue._pending == [] and not queue._busy  # nothing stranded
    fail = False
    cid = chunk_id(200, 0)
    assert trio.run(queue.write, cid, stage(store, cid, 0, b"after")) == {
        "version": 1,
        "length": 5,
    }
