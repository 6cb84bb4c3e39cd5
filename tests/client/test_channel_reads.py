"""The reply-thread read path (client/channel_reads.py: what a mount's fast
READs use) against three real storage daemons serving thread channels and a
real mgmtd in this process: exact bytes at chunk and block edges with many
reads coalesced into one frame per node, damaged blocks never served, a
node dying or going silent with reads in flight failing them for the slow
path to take over, and a dead node's replicas not chosen again."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence

import trio
from clusters import CS, ChainCluster
from harness import flip

from shufflefs.client.channel_reads import ChannelRead, ReadChannels
from shufflefs.client.layout import Extent, plan
from shufflefs.client.storage_client import StorageClient
from shufflefs.metadata.protocol import Layout
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

BLOCK = 512  # the test daemons' block size
INO = 4343
SIZE = 3 * CS + CS // 2
RANGES = [
    (0, 1),
    (0, BLOCK),
    (BLOCK - 1, 2),  # across a block edge
    (BLOCK + 7, BLOCK - 13),  # inside a block, off the grid
    (CS - 1, 1),  # the last byte of chunk 0
    (CS - 1, 2),  # across a chunk edge
    (CS, 1),
    (CS - 100, 2 * CS + 200),  # three chunks, the middle one whole
    (0, SIZE),  # everything
    (SIZE - 10, 100),  # past the end of what was written: zeros
    (5 * CS, 10),  # a chunk never written: a hole
]


def expected(data: bytes, offset: int, length: int) -> bytes:
    got = data[offset : offset + length]
    return got + bytes(length - len(got))


async def setup(cluster: ChainCluster, chains: int | None = None) -> tuple[StorageClient, Layout]:
    storage = StorageClient(
        cluster.rpc, cluster.routing, read_timeout=5.0, retry_budget=10.0, local_reads=False
    )
    storage.start(cluster.nursery)
    ids = cluster.chain_ids()
    return storage, {"chunk_size": CS, "chains": ids[:chains] if chains else ids}


async def connected(channels: ReadChannels, storage: StorageClient, layout: Layout) -> None:
    """Until every replica has a connection (they are opened in the background)."""
    with trio.fail_after(10):
        while not channels.connected(storage.routing.current, layout["chains"]):
            await trio.sleep(0.02)


async def read_batch(
    channels: ReadChannels, storage: StorageClient, extents: Sequence[Extent]
) -> list[tuple[ChannelRead, bytes]]:
    """Each extent as its own read, all in one batch; (read, its bytes)."""
    outs = [bytearray(b"\xa5") * e[3] for e in extents]  # garbage: every byte must be written
    finished = threading.Semaphore(0)
    reads = [
        channels.submit(plan([e]), memoryview(out), lambda r: finished.release())
        for e, out in zip(extents, outs, strict=True)
    ]
    channels.flush(lambda: storage.routing.current)
    for _ in reads:  # `done` runs on a reply thread: wait for it off the loop
        assert await trio.to_thread.run_sync(finished.acquire, True, 10)
    return [(r, bytes(out)) for r, out in zip(reads, outs, strict=True)]


async def test_a_batch_lands_exactly_in_one_frame_per_node(cluster: ChainCluster) -> None:
    storage, layout = await setup(cluster)
    data = os.urandom(SIZE)
    await storage.writes.write(INO, layout, 0, data)
    channels = ReadChannels(cluster.secret_file.read_bytes(), storage.replicas)
    await connected(channels, storage, layout)
    calls_before = sum(n.service_calls("read") for n in cluster.nodes)
    extents = [(INO, layout, o, n) for o, n in RANGES]
    got = await read_batch(channels, storage, extents)
    for (offset, length), (read, bytes_) in zip(RANGES, got, strict=True):
        assert read.ok, (offset, length, read.failures)
        assert bytes_ == expected(data, offset, length), (offset, length)
    frames = sum(n.service_calls("read") for n in cluster.nodes) - calls_before
    assert frames <= len(cluster.nodes)  # every node's share of the batch in one frame
    assert all(v == 0 for v in storage.replicas.outstanding.values())
    # the same again, one read at a time
    for extent in extents:
        ((read, bytes_),) = await read_batch(channels, storage, [extent])
        assert read.ok, (extent[2:], read.failures)
        assert bytes_ == expected(data, extent[2], extent[3])
    channels.close()


async def test_a_damaged_block_is_never_served(cluster: ChainCluster) -> None:
    storage, layout = await setup(cluster, chains=1)
    data = os.urandom(CS)
    await storage.writes.write(INO, layout, 0, data)
    cid = chunk_id(INO, 0)
    targets = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    damaged = targets[0]
    flip(cluster.chunk_file(damaged, cid), 3 * BLOCK + 5)
    channels = ReadChannels(cluster.secret_file.read_bytes(), storage.replicas)
    await connected(channels, storage, layout)
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 100  # so the damaged one is asked
    ((read, got),) = await read_batch(channels, storage, [(INO, layout, 0, CS)])
    assert not read.ok and read.failures == [(damaged, errno.EIO)]
    assert got[3 * BLOCK : 4 * BLOCK] != expected(data, 3 * BLOCK, BLOCK)  # not handed out
    # an intact block of the same chunk is served
    ((read, got),) = await read_batch(channels, storage, [(INO, layout, 5 * BLOCK, BLOCK)])
    assert read.ok and got == data[5 * BLOCK : 6 * BLOCK]
    channels.close()


def stuck_reads(store: ChunkStore) -> tuple[threading.Event, threading.Event]:
    """Make *store*'s reads wait (off the page-cache path) until the first
    event is set; the second is set once a read waits."""
    release, arrived = threading.Event(), threading.Event()
    real_read = store.read

    def stuck(*args: object) -> memoryview:
        arrived.set()
        release.wait(10)
        return real_read(*args)  # type: ignore[arg-type]

    store.read_nowait = lambda *args: None  # type: ignore[method-assign]
    # not through io_uring either: every cold read goes to `read`
    store.read_plan = lambda *args, **kwargs: None  # type: ignore[method-assign]
    store.read = stuck  # type: ignore[method-assign]
    return release, arrived


async def test_a_node_dying_with_reads_in_flight_fails_them_then_is_avoided(
    cluster: ChainCluster,
) -> None:
    storage, layout = await setup(cluster, chains=1)
    data = os.urandom(2 * CS)
    await storage.writes.write(INO, layout, 0, data)
    channels = ReadChannels(cluster.secret_file.read_bytes(), storage.replicas)
    await connected(channels, storage, layout)
    targets = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    victim = targets[0]
    release, arrived = stuck_reads(cluster.node_of(victim).store(victim))
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 100  # so the victim is asked
    out = bytearray(2 * CS)
    finished = threading.Semaphore(0)
    read = channels.submit(
        plan([(INO, layout, 0, 2 * CS)]), memoryview(out), lambda r: finished.release()
    )
    channels.flush(lambda: storage.routing.current)
    # the request is at the victim, waiting for its disk
    assert await trio.to_thread.run_sync(arrived.wait, 10)
    await cluster.stop_node(cluster.node_of(victim), clean=False)  # mgmtd is not told
    release.set()
    assert await trio.to_thread.run_sync(finished.acquire, True, 10)
    assert {tid for tid, _ in read.failures} == {victim}
    assert {code for _, code in read.failures} == {errno.ECONNRESET}
    # its connection is gone (what each READ asks of the connections is
    # remembered, and that memo follows): the next reads go to the others
    chain = layout["chains"][0]
    assert channels._unconnected(storage.routing.current, [chain])[chain] == {victim}
    assert channels.connected(storage.routing.current, [chain])  # (the others are)
    ((again, got),) = await read_batch(channels, storage, [(INO, layout, 0, 2 * CS)])
    assert again.ok and got == data
    for t in targets[1:]:
        storage.replicas.outstanding[t] -= 100
    assert all(v == 0 for v in storage.replicas.outstanding.values())
    channels.close()


async def test_a_silent_node_is_given_up_at_the_deadline(cluster: ChainCluster) -> None:
    storage, layout = await setup(cluster, chains=1)
    await storage.writes.write(INO, layout, 0, os.urandom(CS))
    channels = ReadChannels(cluster.secret_file.read_bytes(), storage.replicas, timeout=0.3)
    await connected(channels, storage, layout)
    targets = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    release, _ = stuck_reads(cluster.node_of(targets[0]).store(targets[0]))
    try:
        for t in targets[1:]:
            storage.replicas.outstanding[t] += 100
        ((read, _),) = await read_batch(channels, storage, [(INO, layout, 0, 4096)])
        assert read.failures == [(targets[0], errno.ETIMEDOUT)]
    finally:
        release.set()
        channels.close()
