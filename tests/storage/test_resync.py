"""Resync, repair and scrub between real storage daemons and a real mgmtd in
this process (tests/chains.py)."""

from __future__ import annotations

import errno
import functools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
import trio
from clusters import CS, ChainCluster, eventually
from harness import flip

from shufflefs.rpc import FsError
from shufflefs.storage.chain import ResyncStats
from shufflefs.storage.protocol import ChunkMeta, StorageStub, chunk_id


def blob(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def test_resync_after_missed_updates_with_writes_going_on(
    cluster: ChainCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The tail misses writes, deletions, truncations and a chunk removed and
    written again (its version restarts at 1, like the stale copy's); it
    comes back and is resynced while writes keep coming; afterwards every
    replica is byte-identical."""
    caplog.set_level(logging.INFO, logger="shufflefs.storage")
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    rng = random.Random(5)
    for ino in range(20, 30):
        for idx in range(6):
            await cluster.write(chain, chunk_id(ino, idx), 0, blob(ino * 100 + idx, 4000))
    tail_node = cluster.node_of(tail)
    await cluster.stop_node(tail_node)
    await cluster.sync_maps()
    # missed while away
    for ino in range(20, 24):
        for idx in range(6):
            cid = chunk_id(ino, idx)
            await cluster.write(chain, cid, rng.randrange(0, 6000), blob(rng.random(), 500))
    await cluster.file_op(chain, 24, CS * 2 + 1000)  # shortened and removed chunks
    await cluster.file_op(chain, 25, None)  # removed file
    await cluster.file_op(chain, 26, None)
    reborn = chunk_id(26, 0)  # removed, then written again: version 1, other bytes
    await cluster.write(chain, reborn, 0, blob(99, 4000))
    for idx in range(6):  # new chunks
        await cluster.write(chain, chunk_id(40, idx), 0, blob(400 + idx, 3000))
    # the source of the resync (the middle) holds one chunk the tail lacks
    # until the chain has forwarded updates to the syncing tail: the copy
    # and the new writes overlap for sure
    slow = chunk_id(40, 5)
    middle_service = cluster.node_of(middle).service
    written = 0

    async def writer(stop: trio.Event) -> None:
        nonlocal written
        while not stop.is_set():
            ino = rng.choice([20, 21, 27, 28, 41])
            cid = chunk_id(ino, rng.randrange(0, 5))
            if rng.random() < 0.3:
                cid = reborn
            length = (await cluster.info(head, cid) or {"length": 0})["length"]
            offset = rng.choice([length, rng.randrange(0, max(1, length))])
            await cluster.write(chain, cid, min(offset, CS - 300), blob(rng.random(), 300))
            written += 1

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        async with middle_service.node.locks.update(middle, slow):
            nursery.start_soon(writer, stop)
            await cluster.start_node(tail_node)  # rejoins as syncing
            await cluster.sync_maps()
            assert cluster.routing.current.targets[tail]["state"] == "syncing"
            tail_service = tail_node.service
            # a client whose map still shows the tail serving is sent elsewhere:
            # until the resync is done it holds stale bytes (and no copy is
            # made from it either)
            missed = chunk_id(20, 0)
            lengths, _ = await cluster.stub_for(tail).read([(tail, missed, 0, CS)])
            assert lengths == [-errno.ESTALE]
            with pytest.raises(FsError) as refused:
                await cluster.stub_for(tail).read_chunk(tail, missed)
            assert refused.value.errno == errno.ESTALE

            def forwarded() -> int:
                sync = tail_service.resyncer.states.get(tail)
                return sync.forwarded if sync is not None else 0

            await eventually(lambda: forwarded() >= 5)
            await cluster.file_op(chain, 27, CS + 10)  # a truncation during the sync too
        assert cluster.state is not None
        await eventually(lambda: cluster.state.targets[tail].state == "serving", timeout=30)
        before = written
        await eventually(lambda: written >= before + 10)  # and writes go on after it
        stop.set()
    await cluster.sync_maps()
    assert cluster.members(chain) == [head, middle, tail]
    state = await cluster.assert_identical(chain)
    assert reborn in state and chunk_id(25, 0) not in state
    assert not any(c[:8] == (24).to_bytes(8, "big") and c[8:] >= b"\0\0\0\3" for c in state)
    await eventually(lambda: bool(tail_service.resyncer.finished))
    [stats] = tail_service.resyncer.finished
    assert stats.chunks_copied > 0 and stats.chunks_deleted > 0 and stats.forwarded >= 5
    assert stats.bytes_copied > 0 and stats.source == middle
    assert any(
        "resync done" in r.getMessage() and "bytes_copied=" in r.getMessage()
        for r in caplog.records
    )


async def test_read_of_a_damaged_chunk_repairs_it(
    cluster: ChainCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shufflefs.storage")
    [chain] = cluster.chain_ids()
    *_, tail = cluster.members(chain)
    cid = chunk_id(30, 0)
    data = blob(30, 5000)
    await cluster.write(chain, cid, 0, data)
    path = cluster.node_of(tail).store(tail).file_path(cid)
    assert path is not None
    flip(path, 1234)
    lengths, _ = await cluster.stub_for(tail).read([(tail, cid, 0, 5000)])
    assert lengths == [-errno.EIO]  # never the damaged bytes; the client reads elsewhere

    await cluster.node_of(tail).service.repairs.run_once()  # the queued repair, done
    assert await cluster.read_all(tail, [cid]) == {cid: data}
    assert any(
        f"repaired target={tail} chunk={cid.hex()}" in r.getMessage() for r in caplog.records
    )
    await cluster.assert_identical(chain)


async def test_scrub_repairs_damage_and_divergence(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cids = [chunk_id(31, i) for i in range(6)]
    for i, cid in enumerate(cids):
        await cluster.write(chain, cid, 0, blob(i, 3000 + i))
    middle_store = cluster.node_of(middle).store(middle)
    tail_store = cluster.node_of(tail).store(tail)
    flip(middle_store.file_path(cids[0]) or "", 10)  # bit rot on the middle
    # the tail diverges: other bytes at the same version, a chunk it lacks,
    # one only it has
    tail_store.commit(tail_store.stage_replace(cids[1], b"diverged" * 100, CS, 1))
    tail_store.remove_chunk(cids[2])
    extra = chunk_id(31, 99)
    tail_store.write(extra, 0, CS, b"zombie")

    async def scrub_all(target: int, limit: int) -> dict[str, int]:
        totals = dict.fromkeys(("checked", "corrupt", "divergent", "repaired", "unrecoverable"), 0)
        after = None
        pages = 0
        while True:
            result = await cluster.stub_for(target).scrub(target, after, limit)
            pages += 1
            for key in totals:
                totals[key] += result[key]
            after = result["next"]
            if after is None:
                totals["pages"] = pages
                return totals

    assert await scrub_all(head, 4) == {
        "checked": 6,
        "corrupt": 0,
        "divergent": 0,
        "repaired": 0,
        "unrecoverable": 0,
        "pages": 2,
    }
    assert await scrub_all(middle, 2) == {
        "checked": 6,
        "corrupt": 1,
        "divergent": 0,
        "repaired": 1,
        "unrecoverable": 0,
        "pages": 3,
    }
    result = await scrub_all(tail, 4)
    assert result["corrupt"] == 0 and result["divergent"] == 3 and result["repaired"] == 3
    await cluster.assert_identical(chain)
    for target in (head, middle, tail):  # clean now
        again = await scrub_all(target, 100)
        assert again["corrupt"] == again["divergent"] == again["repaired"] == 0
    # damage on every replica: nobody can repair it
    victim = cids[4]
    for target in (head, middle, tail):
        flip(cluster.node_of(target).store(target).file_path(victim) or "", 100)
    result = await scrub_all(head, 100)
    assert result["corrupt"] == 1 and result["unrecoverable"] == 1 and result["repaired"] == 0
    for target in (head, middle, tail):
        lengths, _ = await cluster.stub_for(target).read([(target, victim, 0, 10)])
        assert lengths == [-errno.EIO]
    with pytest.raises(FsError) as info:
        await cluster.stub_for(head).scrub(head, None, 0)
    assert info.value.errno == errno.EINVAL


class InterferingSource:
    """The resync's view of its source, with a chain update of the chunk
    landing right after each copy is read and before it is installed (the
    window resync must guard against)."""

    def __init__(self, stub: StorageStub, interfere: Callable[[], Awaitable[None]]) -> None:
        self.stub = stub
        self.interfere = interfere
        self.reads = 0

    async def read_chunk(self, target: int, chunk: bytes) -> tuple[ChunkMeta, bytearray]:
        result = await self.stub.read_chunk(target, chunk)
        self.reads += 1
        if self.reads == 1:
            await self.interfere()
        return result


async def test_resync_waits_out_updates_its_source_took_at_the_older_chain_version(
    cluster: ChainCluster,
) -> None:
    """A replica's map can lag mgmtd's by a poll: updates the source admits
    at the chain version before the tail rejoined are never forwarded to the
    tail, so the tail must not compare chunks until they are done there (its
    pass starts with `sync_barrier`; found as wrong bytes under kill -9 by
    tests/faults/test_chain_ops.py)."""
    [chain] = cluster.chain_ids()
    _, middle, tail = cluster.members(chain)
    cid = chunk_id(60, 0)
    await cluster.write(chain, cid, 0, blob(60, 4000))
    tail_node = cluster.node_of(tail)
    await cluster.stop_node(tail_node)
    await cluster.sync_maps()
    old_version = cluster.routing.current.chains[chain]["version"]
    await cluster.write(chain, cid, 0, blob(61, 4000))  # the tail must copy it
    forwarding = cluster.node_of(middle).service.forwarding
    admitted, release = trio.Event(), trio.Event()

    async def update_at_the_old_version() -> None:
        async with forwarding.admitted(middle, chain, old_version, head=False):
            admitted.set()
            await release.wait()

    assert cluster.state is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(update_at_the_old_version)
        await admitted.wait()
        await cluster.start_node(tail_node)
        await cluster.sync_maps()
        await eventually(lambda: forwarding.barriers_waiting == 1)
        assert cluster.state.targets[tail].state == "syncing"
        release.set()
    await eventually(
        lambda: cluster.state is not None and cluster.state.targets[tail].state == "serving"
    )
    await cluster.sync_maps()
    await cluster.assert_identical(chain)
    new_version = cluster.routing.current.chains[chain]["version"]
    await cluster.stub_for(middle).sync_barrier(middle, chain, new_version)  # nothing to wait for
    with pytest.raises(FsError) as refused:  # a version the source is not at
        await cluster.stub_for(middle).sync_barrier(middle, chain, old_version)
    assert refused.value.code == errno.ESTALE


async def test_resync_copy_never_undoes_an_update_that_overtook_it(
    cluster: ChainCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shufflefs.storage import resync

    monkeypatch.setattr(resync, "RESYNC_PARALLEL", 1)  # the background pass waits at blocker
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    blocker, cid = chunk_id(50, 0), chunk_id(51, 0)
    await cluster.write(chain, blocker, 0, b"blocker")
    await cluster.write(chain, cid, 0, blob(51, 4000))
    tail_node = cluster.node_of(tail)
    await cluster.stop_node(tail_node)
    await cluster.sync_maps()
    await cluster.write(chain, blocker, 0, b"BLOCKER")  # the tail must copy both
    await cluster.write(chain, cid, 0, blob(52, 4000))
    middle_service = cluster.node_of(middle).service
    async with middle_service.node.locks.update(middle, blocker):  # the background pass waits here
        await cluster.start_node(tail_node)
        await cluster.sync_maps()
        tail_service = tail_node.service
        await eventually(
            lambda: tail in tail_service.resyncer.running and tail in tail_service.resyncer.states
        )
        sync = tail_service.resyncer.states[tail]
        assert cid not in sync.trusted
        stats = ResyncStats(tail, chain, middle)

        async def cut(ino: int, size: int) -> None:
            await cluster.file_op(chain, ino, size)

        source = InterferingSource(cluster.stub_for(middle), functools.partial(cut, 51, 1000))
        await tail_service.resyncer.copy_chunk(
            tail, tail_node.store(tail), sync, cast(StorageStub, source), middle, cid, stats
        )
        assert source.reads == 2  # the first copy predates the truncation: read again
        assert stats.chunks_copied == 1
        head_info, tail_info = await cluster.info(head, cid), await cluster.info(tail, cid)
        assert head_info is not None and tail_info is not None
        assert (tail_info["version"], tail_info["length"]) == (head_info["version"], 1000)
    assert cluster.state is not None
    await eventually(lambda: cluster.state.targets[tail].state == "serving")
    await cluster.sync_maps()
    await cluster.assert_identical(chain)


async def test_periodic_scrub_repairs_damage_nobody_reads(
    cluster: ChainCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """One pass of the periodic scrub (what its loop runs every
    ``scrub_interval`` seconds) finds and repairs a chunk nobody reads."""
    caplog.set_level(logging.INFO, logger="shufflefs.storage")
    [chain] = cluster.chain_ids()
    _, middle, _ = cluster.members(chain)
    cid = chunk_id(70, 0)
    await cluster.write(chain, cid, 0, blob(70, 2000))
    flip(cluster.node_of(middle).store(middle).file_path(cid) or "", 1500)
    await cluster.node_of(middle).service.scrubber.run_once()
    assert any(f"repaired target={middle}" in r.getMessage() for r in caplog.records)
    await cluster.assert_identical(chain)
    assert any(
        f"periodic scrub target={middle} checked=1 corrupt=1" in r.getMessage()
        for r in caplog.records
    )


async def test_resync_copies_run_together_and_the_first_failure_ends_them() -> None:
    """`ResyncWorker._copy_each`: up to RESYNC_PARALLEL copies at once (their
    installs share the target's flushes); a copy's FsError stops the rest
    and is raised as itself, not in a group (`resync` tells ESTALE and
    other errors apart by it)."""
    from shufflefs.storage import resync

    running = 0
    most = 0
    done: list[bytes] = []

    async def copy(cid: bytes) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await trio.sleep(0.01)
        running -= 1
        if cid == b"bad":
            raise FsError(errno.ESTALE, "the chain moved")
        done.append(cid)

    cids = [bytes([i]) * 16 for i in range(40)]
    await resync.ResyncWorker._copy_each(cids, copy)
    assert sorted(done) == sorted(cids) and most == resync.RESYNC_PARALLEL
    done.clear()
    with pytest.raises(FsError) as info:
        await resync.ResyncWorker._copy_each([b"bad", *cids], copy)
    assert info.value.errno == errno.ESTALE
    assert len(done) < len(cids)
