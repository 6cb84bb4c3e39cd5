"""`write_many` / `replicate_many` between real storage daemons and a real
mgmtd in this process (tests/clusters.py): each item of a batch ends as its
own `write` would, on every replica; an item's failure is its own; a
failure of the chain fails the batch's items and leaves nothing behind."""

from __future__ import annotations

import errno
import os

import pytest
import trio
from clusters import CS, ChainCluster
from harness import flip

from shufflefs.rpc import FsError
from shufflefs.storage.protocol import MAX_WRITE_ITEMS, WriteResult, chunk_id


def blob(seed: int, n: int) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


async def write_many(
    cluster: ChainCluster, chain: int, writes: list[tuple[bytes, int, bytes]]
) -> list[WriteResult | FsError]:
    """*writes* ((chunk, offset, bytes)) in one `write_many` to the chain's head."""
    routing = await cluster.sync_maps()
    head = routing.serving_targets(chain)[0]["id"]
    version = routing.chain(chain)["version"]
    items = [(head, chain, version, cid, off, CS, len(data)) for cid, off, data in writes]
    return await cluster.stub_for(head).write_many(items, [data for _, _, data in writes])


async def test_a_batch_of_new_chunks_lands_on_every_replica(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    writes = [(chunk_id(100 + i, 0), 0, blob(i, 1000 + 37 * i)) for i in range(40)]
    head = cluster.members(chain)[0]
    before = cluster.node_of(head).service_calls("write_many")
    results = await write_many(cluster, chain, writes)
    assert results == [{"version": 1, "length": len(d)} for _, _, d in writes]
    assert cluster.node_of(head).service_calls("write_many") == before + 1
    for target in cluster.members(chain):  # one replicate_many per replica, not forty
        assert cluster.node_of(target).service_calls("replicate") == 0
    state = await cluster.assert_identical(chain)
    assert {cid: v[:2] for cid, v in state.items()} == {cid: (1, len(d)) for cid, _, d in writes}
    for target in cluster.members(chain):
        got = await cluster.read_all(target, [cid for cid, _, _ in writes])
        assert got == {cid: d for cid, _, d in writes}


async def test_each_item_is_answered_on_its_own(cluster: ChainCluster) -> None:
    """Appends, a copy-on-write overwrite, a zero-length write, a sparse one
    and one that passes the chunk's end, in one batch: the last fails with
    EINVAL alone and changes nothing; the others apply as they would alone."""
    [chain] = cluster.chain_ids()
    a, b, c, d, e = (chunk_id(200 + i, 0) for i in range(5))
    await cluster.write(chain, a, 0, blob(1, 3000))
    await cluster.write(chain, b, 0, blob(2, 3000))
    await cluster.write(chain, e, 0, b"keep")
    results = await write_many(
        cluster,
        chain,
        [
            (a, 3000, blob(3, 500)),  # append
            (b, 100, blob(4, 200)),  # overwrite: copy-on-write
            (c, 0, b""),  # nothing
            (d, 5000, b"sparse"),  # a gap of zeros first
            (e, CS - 2, b"too long"),  # past the chunk's end
        ],
    )
    assert results[:4] == [
        {"version": 2, "length": 3500},
        {"version": 2, "length": 3000},
        {"version": 0, "length": 0},
        {"version": 1, "length": 5006},
    ]
    assert isinstance(results[4], FsError) and results[4].errno == errno.EINVAL
    expected_b = bytearray(blob(2, 3000))
    expected_b[100:300] = blob(4, 200)
    for target in cluster.members(chain):
        got = await cluster.read_all(target, [a, b, d, e])
        assert got == {
            a: blob(1, 3000) + blob(3, 500),
            b: bytes(expected_b),
            d: bytes(5000) + b"sparse",
            e: b"keep",
        }
    await cluster.assert_identical(chain)


async def test_a_replica_behind_gets_its_chunk_whole_within_a_batch(
    cluster: ChainCluster,
) -> None:
    [chain] = cluster.chain_ids()
    _, middle, tail = cluster.members(chain)
    stale, fresh = chunk_id(300, 0), chunk_id(301, 0)
    for i in range(3):
        await cluster.write(chain, stale, i * 1000, blob(i, 1000))
    tail_store = cluster.node_of(tail).store(tail)
    tail_store.commit(tail_store.stage_replace(stale, b"old" * 10, CS, 1))  # back to version 1
    resends = cluster.node_of(middle).service.forwarding.full_resends
    results = await write_many(cluster, chain, [(stale, 3000, blob(9, 100)), (fresh, 0, b"new")])
    assert results == [{"version": 4, "length": 3100}, {"version": 1, "length": 3}]
    assert cluster.node_of(middle).service.forwarding.full_resends == resends + 1
    await cluster.assert_identical(chain)
    whole = blob(0, 1000) + blob(1, 1000) + blob(2, 1000) + blob(9, 100)
    assert await cluster.read_all(tail, [stale, fresh]) == {stale: whole, fresh: b"new"}


async def test_a_dead_successor_fails_the_batch_and_leaves_nothing(
    cluster: ChainCluster,
) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    old = chunk_id(400, 0)
    await cluster.write(chain, old, 0, b"before")
    await cluster.stop_node(cluster.node_of(tail), clean=False)  # gone without a word
    new = [chunk_id(401 + i, 0) for i in range(5)]
    routing = cluster.routing.current
    items = [(head, chain, routing.chain(chain)["version"], old, 6, CS, 6)]
    items += [(head, chain, routing.chain(chain)["version"], cid, 0, CS, 4) for cid in new]
    results = await cluster.stub_for(head).write_many(items, [b" after"] + [b"file"] * 5)
    for result in results:
        assert isinstance(result, FsError) and result.errno == errno.ESTALE
        assert "unreachable" in result.strerror
    for target in (head, middle):  # aborted everywhere: as before the batch
        got = await cluster.read_all(target, [old, *new])
        assert got == {old: b"before", **{cid: b"" for cid in new}}
        store = cluster.node_of(target).store(target)
        assert os.path.getsize(store.file_path(old) or "") == 6
    # retried on the new chain: two replicas
    results = await write_many(
        cluster, chain, [(old, 6, b" after")] + [(c, 0, b"file") for c in new]
    )
    assert [r["version"] for r in results if isinstance(r, dict)] == [2, 1, 1, 1, 1, 1]
    assert cluster.members(chain) == [head, middle]
    await cluster.assert_identical(chain)


async def test_bad_batches_get_a_clear_error_and_change_nothing(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head = cluster.members(chain)[0]
    version = cluster.routing.current.chain(chain)["version"]
    stub = cluster.stub_for(head)
    cid = chunk_id(500, 0)

    async def refused(items: list[tuple[object, ...]], data: list[bytes]) -> FsError:
        with pytest.raises(FsError) as info:
            await stub.write_many(items, data)  # type: ignore[arg-type]
        return info.value

    item = (head, chain, version, cid, 0, CS, 4)
    error = await refused([item, item], [b"abcd", b"efgh"])
    assert error.errno == errno.EINVAL and "twice" in error.strerror
    error = await refused([item], [b"abcdef"])
    assert error.errno == errno.EINVAL and "belong to no item" in error.strerror
    error = await refused([(head, chain, version, cid, 0, CS, 8)], [b"abcd"])
    assert error.errno == errno.EINVAL and "do not match" in error.strerror
    error = await refused([item] * (MAX_WRITE_ITEMS + 1), [b"abcd"] * (MAX_WRITE_ITEMS + 1))
    assert error.errno == errno.EMSGSIZE
    error = await refused([(head, chain, version, "not bytes", 0, CS, 4)], [b"abcd"])
    assert error.errno == errno.EINVAL
    error = await refused([(head, chain, version, cid, 0, CS)], [b"abcd"])  # one field short
    assert error.errno == errno.EINVAL
    [result] = await stub.write_many([(head, chain, version, b"short", 0, CS, 4)], [b"abcd"])
    assert isinstance(result, FsError) and result.errno == errno.EINVAL  # a bad chunk id
    for target in cluster.members(chain):
        assert await cluster.read_all(target, [cid]) == {cid: b""}
    [result] = await stub.write_many([item], [b"abcd"])  # the daemon serves on
    assert result == {"version": 1, "length": 4}


async def test_a_damaged_head_copy_fails_its_item_alone_and_is_repaired(
    cluster: ChainCluster,
) -> None:
    """In a batch, a partial overwrite where the head's own copy is damaged
    gets EAGAIN (a repair from another replica is queued) while the batch's
    other items land; retried, it lands too, and every replica agrees."""
    [chain] = cluster.chain_ids()
    head = cluster.members(chain)[0]
    damaged, other = chunk_id(600, 0), chunk_id(601, 0)
    await cluster.write(chain, damaged, 0, blob(1, 3000))
    flip(cluster.chunk_file(head, damaged), 10)  # a flipped byte in the head's first block
    first, second = await write_many(cluster, chain, [(damaged, 5, b"new"), (other, 0, b"fine")])
    assert isinstance(first, FsError) and first.errno == errno.EAGAIN
    assert second == {"version": 1, "length": 4}
    expected = blob(1, 5) + b"new" + blob(1, 3000)[8:]
    for _ in range(100):  # the client's retry, until the repair is in
        [result] = await write_many(cluster, chain, [(damaged, 5, b"new")])
        if not isinstance(result, FsError):
            break
        assert result.errno == errno.EAGAIN
        await trio.sleep(0.05)
    await cluster.assert_identical(chain)
    for target in cluster.members(chain):
        got = await cluster.read_all(target, [damaged, other])
        assert got == {damaged: expected, other: b"fine"}


async def test_a_successor_without_replicate_many_gets_each_update_alone(
    cluster: ChainCluster,
) -> None:
    """A rolling upgrade: the middle answers ENOSYS for `replicate_many`;
    the head forwards each update of its batch as a `replicate`, and the
    batch lands on every replica."""
    [chain] = cluster.chain_ids()
    _, middle, _ = cluster.members(chain)
    service = cluster.node_of(middle).service

    async def unknown(*args: object, **kwargs: object) -> None:
        raise FsError(errno.ENOSYS, "unknown method 'replicate_many'")

    service.batches.replicate_many = unknown  # type: ignore[method-assign,assignment]
    writes = [(chunk_id(700 + i, 0), 0, blob(i, 500)) for i in range(5)]
    results = await write_many(cluster, chain, writes)
    assert results == [{"version": 1, "length": 500}] * 5
    assert cluster.node_of(middle).service_calls("replicate") == 5
    await cluster.assert_identical(chain)
    for target in cluster.members(chain):
        got = await cluster.read_all(target, [cid for cid, _, _ in writes])
        assert got == {cid: d for cid, _, d in writes}
