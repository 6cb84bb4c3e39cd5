"""Group commit: mutations queued while a commit runs share the next one;
each is nested, so one that fails is rolled back alone with its own error,
and each caller returns only after the commit that holds its mutation."""

from __future__ import annotations

import errno

import pytest
import trio

from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.records import DB_COUNTERS
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.txn import Tx
from shufflefs.metadata.writer import MAX_GROUP, Writer
from shufflefs.rpc.errors import FsError


def half_done(tx: Tx) -> None:
    """A mutation that writes, then fails: none of it may remain."""
    tx.put(DB_COUNTERS, b"half", b"x")
    raise FsError(errno.EIO, "failed halfway")


async def test_concurrent_mutations_share_commits(ns: NamespaceStore) -> None:
    write = Writer(ns.txns)
    names = [b"d%d" % (i % 40) for i in range(80)]  # every name twice: one EEXIST each
    outcomes: dict[int, tuple[str, int]] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = ("ino", (await write(ns.mkdir, ROOT_INODE, names[i], 0o755, 0, 0))["ino"])
        except FsError as exc:
            outcomes[i] = ("errno", exc.code)

    async def failing() -> None:
        with pytest.raises(FsError) as info:
            await write(ns.txns.write, half_done)
        outcomes[-1] = ("errno", info.value.code)

    commits = ns.txns.commit_count
    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(one, i)
        nursery.start_soon(failing)
        for i in range(40, 80):
            nursery.start_soon(one, i)
    groups = ns.txns.commit_count - commits
    assert groups < 10  # 81 mutations, far fewer commits
    assert outcomes.pop(-1) == ("errno", errno.EIO)
    by_name: dict[bytes, list[tuple[str, int]]] = {}
    for i, outcome in outcomes.items():
        by_name.setdefault(names[i], []).append(outcome)
    for name, results in by_name.items():
        made = ("ino", ns.lookup(ROOT_INODE, name)["ino"])
        assert sorted(results) == sorted([made, ("errno", errno.EEXIST)]), name
    assert ns.txns.read(lambda tx: tx.get_raw(DB_COUNTERS, b"half")) is None
    assert len(ns.readdir(ROOT_INODE, None, 1024)["entries"]) == 40


async def test_group_size_is_capped(ns: NamespaceStore) -> None:
    write = Writer(ns.txns)
    commits = ns.txns.commit_count
    async with trio.open_nursery() as nursery:
        for i in range(2 * MAX_GROUP + 10):
            nursery.start_soon(write, ns.mkdir, ROOT_INODE, b"d%d" % i, 0o755, 0, 0)
    assert ns.txns.commit_count - commits >= 3
    assert len(ns.readdir(ROOT_INODE, None, 1024)["entries"]) == 2 * MAX_GROUP + 10


async def test_read_only_group_takes_no_write_transaction(ns: NamespaceStore) -> None:
    write = Writer(ns.txns)
    before = ns.txns.write_count, ns.txns.commit_count
    assert await write(ns.reap_sessions) == []
    assert (ns.txns.write_count, ns.txns.commit_count) == before
