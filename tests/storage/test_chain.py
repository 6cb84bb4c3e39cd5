"""Chain replication between real storage daemons and a real mgmtd, all in
this process on loopback (tests/chains.py): writes, staging visibility,
min_replicas, full resends, dead successors, truncate/remove, disk full."""

from __future__ import annotations

import errno
import functools
import os

import pytest
import trio
from clusters import CS, ChainCluster, eventually
from harness import flip

from shufflefs.rpc import FsError
from shufflefs.storage.protocol import NEED_FULL, chunk_id


def blob(seed: int, n: int) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


async def test_three_replica_write_lands_on_all_three(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    members = cluster.members(chain)
    assert len(members) == 3
    nodes = {cluster.routing.current.targets[t]["node"] for t in members}
    assert len(nodes) == 3  # distinct nodes
    a, b = chunk_id(7, 0), chunk_id(7, 1)
    assert await cluster.write(chain, a, 0, blob(1, 5000)) == {"version": 1, "length": 5000}
    assert (await cluster.write(chain, a, 5000, blob(2, 3000)))["version"] == 2  # append
    assert (await cluster.write(chain, a, 100, blob(3, 700)))["version"] == 3  # overwrite (COW)
    assert await cluster.write(chain, b, 9000, b"sparse") == {"version": 1, "length": 9006}
    assert (await cluster.write(chain, a, 0, b""))["version"] == 3  # zero length: nothing
    state = await cluster.assert_identical(chain)
    assert {c: v[:2] for c, v in state.items()} == {a: (3, 8000), b: (1, 9006)}
    expected = bytearray(blob(1, 5000) + blob(2, 3000))
    expected[100:800] = blob(3, 700)
    for target in members:  # every replica serves the acknowledged bytes
        got = await cluster.read_all(target, [a, b])
        assert got == {a: bytes(expected), b: bytes(9000) + b"sparse"}


async def test_reads_never_see_staged_updates(cluster: ChainCluster) -> None:
    """Freeze a write between stage and commit (the tail's chunk lock is held)
    and read from every replica: the old bytes, while the new ones are
    already on disk at the head and the middle."""
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cid = chunk_id(8, 0)
    await cluster.write(chain, cid, 0, b"old!" * 256)

    def staged_on(target: int, *, cow: bool) -> bool:
        store = cluster.node_of(target).store(target)
        rec = store.committed(cid)
        assert rec is not None
        if cow:  # a second generation file of the chunk exists
            folder = os.path.dirname(store.file_path(cid) or "")
            return sum(1 for n in os.listdir(folder) if n.startswith(cid.hex())) == 2
        return os.path.getsize(store.file_path(cid) or "") > rec.length  # bytes past the end

    for offset, data, cow in ((1024, b"appended" * 64, False), (0, b"NEW!" * 256, True)):
        before = await cluster.read_all(head, [cid])
        done = trio.Event()
        tail_service = cluster.node_of(tail).service
        async with tail_service.node.locks.update(tail, cid):

            async def writer(offset: int, data: bytes, done: trio.Event) -> None:
                await cluster.write(chain, cid, offset, data)
                done.set()

            cluster.nursery.start_soon(writer, offset, data, done)
            both_staged = functools.partial(
                lambda c: staged_on(head, cow=c) and staged_on(middle, cow=c), cow
            )
            await eventually(both_staged)
            for target in (head, middle, tail):
                assert await cluster.read_all(target, [cid]) == before
                info = await cluster.info(target, cid)
                assert info is not None and info["version"] == (2 if not cow else 3) - 1
            assert not done.is_set()
        await eventually(done.is_set)
        after = bytearray(before[cid])
        after[offset : offset + len(data)] = data
        for target in (head, middle, tail):
            assert await cluster.read_all(target, [cid]) == {cid: bytes(after)}
        await cluster.assert_identical(chain)


async def test_below_min_replicas_is_erofs(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cid = chunk_id(9, 0)
    await cluster.stop_node(cluster.node_of(tail))
    await cluster.sync_maps()
    assert (await cluster.write(chain, cid, 0, b"two replicas"))["version"] == 1  # 2 >= min
    await cluster.stop_node(cluster.node_of(middle))
    routing = await cluster.sync_maps()
    assert [t["id"] for t in routing.serving_targets(chain)] == [head]
    with pytest.raises(FsError) as info:
        await cluster.stub_for(head).write(
            head, chain, routing.chain(chain)["version"], cid, 0, CS, b"one replica"
        )
    assert info.value.errno == errno.EROFS and "min_replicas=2" in info.value.strerror
    assert await cluster.read_all(head, [cid]) == {cid: b"two replicas"}


async def test_replica_behind_gets_the_whole_chunk(cluster: ChainCluster) -> None:
    """The tail holds an old version (it missed several updates): the delta is
    refused with NEED_FULL and its predecessor sends the whole chunk."""
    [chain] = cluster.chain_ids()
    _, middle, tail = cluster.members(chain)
    cid = chunk_id(10, 0)
    for i in range(5):
        await cluster.write(chain, cid, i * 1000, blob(i, 1000))
    tail_store = cluster.node_of(tail).store(tail)
    staged = tail_store.stage_replace(cid, b"stale" * 100, CS, 2)  # back to version 2
    tail_store.commit(staged)
    assert (await cluster.info(tail, cid) or {}).get("version") == 2
    with pytest.raises(FsError) as info:  # the refusal itself, as the middle sees it
        await cluster.stub_for(tail).replicate(
            tail,
            chain,
            cluster.routing.current.chain(chain)["version"],
            cid,
            0,
            CS,
            6,
            5,
            False,
            b"x",
        )
    assert info.value.errno == NEED_FULL
    middle_service = cluster.node_of(middle).service
    resends = middle_service.forwarding.full_resends
    assert (await cluster.write(chain, cid, 5000, blob(9, 100)))["version"] == 6
    assert middle_service.forwarding.full_resends == resends + 1
    await cluster.assert_identical(chain)
    expected = b"".join(blob(i, 1000) for i in range(5)) + blob(9, 100)
    assert await cluster.read_all(tail, [cid]) == {cid: expected}


async def test_a_write_the_head_fails_after_forwarding_is_healed_by_the_next(
    cluster: ChainCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head forwards a write while it stages it: when its own stage
    then fails (its disk filled after it checked for room), the client gets
    the error and the replicas behind may be a version ahead; the next write
    of the chunk finds them so (NEED_FULL), resends the whole chunk as the
    head has it, and the chain is identical again."""
    [chain] = cluster.chain_ids()
    head, _, _ = cluster.members(chain)
    cid = chunk_id(15, 0)
    await cluster.write(chain, cid, 0, blob(1, 3000))
    store = cluster.node_of(head).store(head)

    def disk_filled(*args: object, **kwargs: object) -> None:
        raise FsError(errno.ENOSPC, "injected: no space left")

    with monkeypatch.context() as patch:
        patch.setattr(store, "stage_write", disk_filled)
        with pytest.raises(FsError) as info:
            await cluster.write(chain, cid, 3000, blob(2, 500))
        assert info.value.errno == errno.ENOSPC
    assert (await cluster.info(head, cid) or {}).get("version") == 1  # nothing here
    resends = cluster.node_of(head).service.forwarding.full_resends
    assert (await cluster.write(chain, cid, 3000, blob(3, 100)))["version"] == 2
    assert cluster.node_of(head).service.forwarding.full_resends == resends + 1
    state = await cluster.assert_identical(chain)
    assert state[cid][:2] == (2, 3100)
    assert await cluster.read_all(head, [cid]) == {cid: blob(1, 3000) + blob(3, 100)}


async def test_the_heads_damaged_copy_is_repaired_and_the_write_retried(
    cluster: ChainCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial overwrite at a head whose own copy is damaged there: EAGAIN
    while the copy is repaired from another replica (the replicas behind
    took the forwarded write meanwhile), then the retry lands; the damage
    is never sent on, and every replica ends with the acknowledged bytes."""
    [chain] = cluster.chain_ids()
    head, _, _ = cluster.members(chain)
    cid = chunk_id(16, 0)
    await cluster.write(chain, cid, 0, blob(1, 3000))
    flip(cluster.chunk_file(head, cid), 10)  # a flipped byte in the head's first block
    repairs = cluster.node_of(head).service.repairs
    scheduled: list[tuple[int, bytes]] = []
    schedule = repairs.schedule

    def recorded(target: int, chunk: bytes) -> None:
        scheduled.append((target, chunk))
        schedule(target, chunk)

    monkeypatch.setattr(repairs, "schedule", recorded)
    await cluster.write(chain, cid, 5, b"new")  # EAGAIN until repaired, retried
    assert (head, cid) in scheduled
    state = await cluster.assert_identical(chain)
    assert state[cid][1] == 3000
    expected = blob(1, 5) + b"new" + blob(1, 3000)[8:]
    for target in cluster.members(chain):
        assert await cluster.read_all(target, [cid]) == {cid: expected}


async def test_dead_successor_fails_transiently_and_is_reported(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cid = chunk_id(11, 0)
    await cluster.write(chain, cid, 0, b"before")
    tail_node = cluster.node_of(tail)
    tail_node_id = tail_node.node_id
    await cluster.stop_node(tail_node, clean=False)  # gone without a word to mgmtd
    assert cluster.state is not None and cluster.state.nodes[tail_node_id].state == "online"
    routing = cluster.routing.current
    with pytest.raises(FsError) as info:
        await cluster.stub_for(head).write(
            head, chain, routing.chain(chain)["version"], cid, 6, CS, b" after"
        )
    assert info.value.errno == errno.ESTALE and "unreachable" in info.value.strerror
    # reported by the middle, confirmed by mgmtd: the node is out, the chain changed
    assert cluster.state.nodes[tail_node_id].state == "offline"
    assert cluster.state.targets[tail].state == "offline"
    for target in (head, middle):  # the failed write was aborted everywhere
        assert (await cluster.info(target, cid) or {}).get("version") == 1
        assert await cluster.read_all(target, [cid]) == {cid: b"before"}
        store = cluster.node_of(target).store(target)
        assert os.path.getsize(store.file_path(cid) or "") == 6  # the staged tail was cut
    # the client retries with the new chain version and succeeds on two replicas
    assert (await cluster.write(chain, cid, 6, b" after"))["version"] == 2
    assert cluster.members(chain) == [head, middle]
    await cluster.assert_identical(chain)


async def test_truncate_and_remove_travel_the_chain(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, _ = cluster.members(chain)
    ino = 12
    for idx in range(4):
        await cluster.write(chain, chunk_id(ino, idx), 0, blob(idx, CS))
    await cluster.write(chain, chunk_id(ino + 1, 0), 0, b"other file")
    assert await cluster.file_op(chain, ino, CS + 1000) == 3  # one cut, two removed
    state = await cluster.assert_identical(chain)
    assert {c: v[:2] for c, v in state.items() if c[:8] == ino.to_bytes(8, "big")} == {
        chunk_id(ino, 0): (1, CS),
        chunk_id(ino, 1): (2, 1000),
    }
    routing = cluster.routing.current
    with pytest.raises(FsError) as info:  # only the head takes it
        await cluster.stub_for(middle).truncate_file(
            middle, chain, routing.chain(chain)["version"], ino, 0, CS
        )
    assert info.value.errno == errno.ESTALE
    with pytest.raises(FsError) as info:  # an old chain version
        await cluster.stub_for(head).remove_file(head, chain, 0, ino)
    assert info.value.errno == errno.ESTALE
    assert await cluster.file_op(chain, ino, None) == 2
    assert await cluster.file_op(chain, ino, None) == 0  # idempotent
    state = await cluster.assert_identical(chain)
    assert list(state) == [chunk_id(ino + 1, 0)]


async def test_a_batch_of_files_is_removed_on_every_replica(cluster: ChainCluster) -> None:
    """`remove_files` (garbage collection's batches): every named file's
    chunks gone on every replica, the others kept; idempotent; only the
    head takes it, at the chain's version."""
    [chain] = cluster.chain_ids()
    head, middle, _ = cluster.members(chain)
    for ino in range(30, 40):
        for idx in range(2):
            await cluster.write(chain, chunk_id(ino, idx), 0, blob(idx, 1000))
    version = cluster.routing.current.chain(chain)["version"]
    stub = cluster.stub_for(head)
    batch = [31, 33, 35, 37, 39, 33, 999]  # (a duplicate, a file with no chunk here)
    assert await stub.remove_files(head, chain, version, batch) == 10
    state = await cluster.assert_identical(chain)
    assert sorted({int.from_bytes(c[:8], "big") for c in state}) == [30, 32, 34, 36, 38]
    assert await stub.remove_files(head, chain, version, batch) == 0
    for where, ver in ((middle, version), (head, 0)):  # not the head; an old version
        with pytest.raises(FsError) as info:
            await cluster.stub_for(where).remove_files(where, chain, ver, [30])
        assert info.value.errno == errno.ESTALE
    assert len(await cluster.assert_identical(chain)) == 10


async def test_truncate_is_ordered_with_writes(cluster: ChainCluster) -> None:
    """Writes to new chunks of a file race with truncations of it: every
    replica ends up with the same chunks, whichever came first. No cut
    reaches chunk 0, so the replicas compared are never empty."""
    [chain] = cluster.chain_ids()
    ino = 13
    last_cut = CS + 100

    async def writes() -> None:
        for idx in range(24):
            await cluster.write(chain, chunk_id(ino, idx), 0, blob(idx, 3000))

    async def cuts() -> None:
        for size in (20 * CS, 12 * CS + 5, 3 * CS, last_cut):
            await trio.sleep(0.01)
            await cluster.file_op(chain, ino, size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes)
        nursery.start_soon(cuts)
    state = await cluster.assert_identical(chain)
    cids = sorted(c for c in state if c[:8] == ino.to_bytes(8, "big"))
    assert chunk_id(ino, 0) in cids, "chunk 0 (never cut) is missing: nothing was compared"
    for target in cluster.members(chain):
        content = await cluster.read_all(target, cids)
        for cid, data in content.items():
            idx = int.from_bytes(cid[8:], "big")
            # written after the last cut: whole; before it: cut to the new size
            whole = blob(idx, 3000)
            assert data in (whole, whole[: max(0, last_cut - idx * CS)]) and data


async def test_truncate_to_zero_is_ordered_with_writes(cluster: ChainCluster) -> None:
    """The cut to 0 raced with writes: a chunk written before it is gone on
    every replica, one written after it is whole on every replica. A write
    after the race makes sure the replicas compared are not empty."""
    [chain] = cluster.chain_ids()
    ino = 15

    async def writes() -> None:
        for idx in range(24):
            await cluster.write(chain, chunk_id(ino, idx), 0, blob(idx, 3000))

    async def cuts() -> None:
        for size in (8 * CS, 0):
            await trio.sleep(0.01)
            await cluster.file_op(chain, ino, size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes)
        nursery.start_soon(cuts)
    await cluster.write(chain, chunk_id(ino, 30), 0, blob(30, 3000))
    state = await cluster.assert_identical(chain)
    cids = sorted(c for c in state if c[:8] == ino.to_bytes(8, "big"))
    assert chunk_id(ino, 30) in cids, "the chunk written last is missing"
    for target in cluster.members(chain):
        content = await cluster.read_all(target, cids)
        assert set(content) == set(cids)
        for cid, data in content.items():
            assert data == blob(int.from_bytes(cid[8:], "big"), 3000)


async def test_disk_full_fails_cleanly_everywhere(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cid = chunk_id(14, 0)
    await cluster.write(chain, cid, 0, b"kept" * 100)

    def leftovers(target: int) -> list[str]:
        store = cluster.node_of(target).store(target)
        folder = os.path.dirname(store.file_path(cid) or "")
        return sorted(n for n in os.listdir(folder) if n.startswith(cid.hex()))

    files = {t: leftovers(t) for t in (head, middle, tail)}
    for full in (tail, middle, head):
        store = cluster.node_of(full).store(full)
        store.reserve_bytes = 1 << 62  # this target's disk is full
        try:
            for offset, data in ((400, b"append" * 50), (0, b"overwrite")):
                with pytest.raises(FsError) as info:
                    await cluster.write(chain, cid, offset, data)
                assert info.value.errno == errno.ENOSPC
                for target in (head, middle, tail):  # nothing committed, nothing left over
                    assert (await cluster.info(target, cid) or {}).get("version") == 1
                    assert await cluster.read_all(target, [cid]) == {cid: b"kept" * 100}
                    assert leftovers(target) == files[target]
                    tstore = cluster.node_of(target).store(target)
                    assert os.path.getsize(tstore.file_path(cid) or "") == 400
        finally:
            store.reserve_bytes = 0
    assert (await cluster.write(chain, cid, 400, b"room again"))["version"] == 2
    await cluster.assert_identical(chain)
