"""The lock table that orders updates of chunks and files on a storage node."""

from __future__ import annotations

import trio
from trio.testing import wait_all_tasks_blocked

from shufflefs.storage.chain import LockTable
from shufflefs.storage.protocol import chunk_id


async def test_file_lock_orders_updates_and_whole_file_operations() -> None:
    locks = LockTable()
    a, b = chunk_id(1, 0), chunk_id(1, 1)
    events: list[str] = []
    release = trio.Event()

    async def update(cid: bytes, name: str, hold: bool) -> None:
        async with locks.update(1, cid):
            events.append(f"{name}+")
            if hold:
                await release.wait()
            events.append(f"{name}-")

    async def truncate() -> None:
        async with locks.whole_file(1, 1):
            events.append("T+")
            events.append("T-")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(update, a, "A", True)
        nursery.start_soon(update, b, "B", True)  # another chunk: runs alongside A
        await wait_all_tasks_blocked()
        nursery.start_soon(truncate)  # waits for A and B
        await wait_all_tasks_blocked()
        nursery.start_soon(update, a, "C", False)  # after the truncation, though A holds a
        nursery.start_soon(update, chunk_id(2, 0), "D", False)  # another file: not held up
        await wait_all_tasks_blocked()
        # trio runs ready tasks in no fixed order: A and B either way round
        assert sorted(events[:2]) == ["A+", "B+"] and events[2:] == ["D+", "D-"]
        release.set()
    assert sorted(events[4:6]) == ["A-", "B-"] and events[6:] == ["T+", "T-", "C+", "C-"]
    assert len(locks) == 0  # nothing left behind


async def test_cancelled_waiter_releases_nothing_it_did_not_take() -> None:
    locks = LockTable()
    cid = chunk_id(3, 0)
    got: list[str] = []

    async def waiter() -> None:  # another task: trio locks belong to their task
        with trio.move_on_after(0.01):
            async with locks.whole_file(1, 3):  # waits, cancelled
                got.append("file")
        with trio.move_on_after(0.01):
            async with locks.update(1, cid):  # the same chunk: waits, cancelled
                got.append("chunk")
        # the cancelled exclusive waiter does not keep shared holders out
        with trio.fail_after(1):
            async with locks.update(1, chunk_id(3, 1)):
                got.append("other chunk")

    async with locks.update(1, cid), trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
    assert got == ["other chunk"]
    async with locks.whole_file(1, 3):
        pass
    assert len(locks) == 0
