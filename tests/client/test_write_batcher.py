"""Chunk writes to one head coalesced into `write_many` frames
(client/write_batcher.py), against real storage daemons and mgmtd in this
process (tests/clusters.py): each write ends exactly as it would alone."""

from __future__ import annotations

import errno

import trio
from clusters import CS, ChainCluster

from shufflefs.client.storage_client import StorageClient
from shufflefs.client.write_batcher import FRAMES_IN_FLIGHT, ChunkWrite, WriteBatcher
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import WriteResult, chunk_id


def blob(seed: int, n: int) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(n))


def storage_client(cluster: ChainCluster) -> StorageClient:
    storage = StorageClient(cluster.rpc, cluster.routing, retry_budget=10.0, local_reads=False)
    storage.start(cluster.nursery)
    return storage


async def test_concurrent_small_files_share_frames_and_land_whole(cluster: ChainCluster) -> None:
    """Sixty files written at once through the chain writer: far fewer
    frames than files, and every replica holds every file's bytes."""
    storage = storage_client(cluster)
    layout: Layout = {"chunk_size": CS, "chains": cluster.chain_ids()}
    [chain] = cluster.chain_ids()
    files = {7000 + i: blob(i, 3000 + 101 * i) for i in range(60)}

    async with trio.open_nursery() as nursery:
        for ino, data in files.items():
            nursery.start_soon(storage.writes.write, ino, layout, 0, data)
    batcher = storage.writes.batcher
    assert batcher.requests_sent == 60
    assert batcher.frames_sent < 30  # coalesced (the first goes alone)
    head = cluster.members(chain)[0]
    assert cluster.node_of(head).service_calls("write_many") >= 1
    await cluster.assert_identical(chain)
    for target in cluster.members(chain):
        cids = [chunk_id(ino, 0) for ino in files]
        got = await cluster.read_all(target, cids)
        assert got == {chunk_id(ino, 0): data for ino, data in files.items()}


async def test_each_write_gets_its_own_answer(cluster: ChainCluster) -> None:
    """In one frame, a write past its chunk's end fails with EINVAL alone;
    a second write of a chunk already in the frame waits for the next one."""
    [chain] = cluster.chain_ids()
    head = cluster.members(chain)[0]
    address = cluster.routing.current.target_address(head)
    version = cluster.routing.current.chain(chain)["version"]
    batcher = WriteBatcher(cluster.rpc, 10.0)
    a, b, c, d = (chunk_id(8000 + i, 0) for i in range(4))
    writes: list[ChunkWrite] = [
        (head, chain, version, a, 0, CS, b"first"),  # alone: nothing queued yet
        (head, chain, version, b, 0, CS, blob(1, 900)),  # queued from here on
        (head, chain, version, c, CS - 1, CS, b"too long"),
        (head, chain, version, d, 0, CS, b"x"),
        (head, chain, version, d, 100, CS, b"y"),  # chunk d again: the next frame
    ]
    got: dict[int, WriteResult | int] = {}

    async def one(i: int) -> None:
        try:
            got[i] = await batcher.write(address, writes[i], 10.0)
        except FsError as exc:
            got[i] = exc.errno

    async with trio.open_nursery() as nursery:
        for i in range(len(writes)):
            nursery.start_soon(one, i)
            await trio.sleep(0)  # in this order
    assert [got[0], got[1], got[2]] == [
        {"version": 1, "length": 5},
        {"version": 1, "length": 900},
        errno.EINVAL,
    ]
    on_d = [got[3], got[4]]  # (two writes in flight at once: either may land first)
    assert all(isinstance(r, dict) for r in on_d)
    assert sorted(r["version"] for r in on_d if isinstance(r, dict)) == [1, 2]
    assert FRAMES_IN_FLIGHT == 1
    assert batcher.frames_sent == 3  # [a], [b, c, d], [d]
    for target in cluster.members(chain):
        assert await cluster.read_all(target, [a, b, c, d]) == {
            a: b"first",
            b: blob(1, 900),
            c: b"",
            d: b"x" + bytes(99) + b"y",
        }


async def test_a_daemon_without_write_many_gets_each_write_alone(cluster: ChainCluster) -> None:
    """ENOSYS for the batch (a daemon from before `write_many`): each write
    in it is sent again as a plain `write`, and succeeds."""
    [chain] = cluster.chain_ids()
    head = cluster.members(chain)[0]
    service = cluster.node_of(head).service

    async def unknown(*args: object, **kwargs: object) -> None:
        raise FsError(errno.ENOSYS, "unknown method 'write_many'")

    service.batches.write_many = unknown  # type: ignore[method-assign,assignment]
    address = cluster.routing.current.target_address(head)
    version = cluster.routing.current.chain(chain)["version"]
    batcher = WriteBatcher(cluster.rpc, 10.0)
    cids = [chunk_id(8100 + i, 0) for i in range(4)]
    results: list[WriteResult] = []

    async def one(cid: bytes) -> None:
        results.append(await batcher.write(address, (head, chain, version, cid, 0, CS, cid), 10.0))

    async with trio.open_nursery() as nursery:
        for cid in cids:
            nursery.start_soon(one, cid)
    assert results == [{"version": 1, "length": 12}] * 4
    for target in cluster.members(chain):
        assert await cluster.read_all(target, cids) == {cid: cid for cid in cids}
