"""The storage side of the client (`StorageClient`: replica choice, the read
engine, the short circuit, the blocking native path, chain writes) against
three real storage daemons and a real mgmtd in this process; concurrent
reads coalesced into one frame per node (`ReadBatcher`) at the end."""

from __future__ import annotations

import copy
import errno
import os
import random
import time
from collections.abc import Sequence

import trio
from clusters import CS, ChainCluster
from harness import flip
from hypothesis import given, settings
from hypothesis import strategies as st

from shufflefs.client.blocking_read import BlockingReader
from shufflefs.client.layout import Extent, Piece, plan
from shufflefs.client.read_batcher import QueuedRead, ReadBatcher, split_reply
from shufflefs.client.read_engine import ReadEngine, landing_views
from shufflefs.client.replicas import REMOTE_PENALTY, SPREAD_THRESHOLD, Replicas
from shufflefs.client.storage_client import StorageClient
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id

BLOCK = 512  # the test daemons' block size
INO = 4242


def layout_of(cluster: ChainCluster) -> Layout:
    return {"chunk_size": CS, "chains": cluster.chain_ids()}


def storage_client(cluster: ChainCluster, *, local_reads: bool) -> StorageClient:
    storage = StorageClient(
        cluster.rpc, cluster.routing, read_timeout=5.0, retry_budget=10.0, local_reads=local_reads
    )
    storage.start(cluster.nursery)
    return storage


def dirty(n: int) -> bytearray:
    """A buffer of garbage, as `rpc.heap.uninitialized` may give: a read
    must write every byte of what it is asked for (zeros past a chunk's end
    and in a hole included), never leave what was there."""
    return bytearray(b"\xa5") * n


async def read(storage: StorageClient, extents: Sequence[Extent]) -> bytes:
    out = dirty(sum(e[3] for e in extents))
    await storage.reads.read(plan(extents), memoryview(out))
    return bytes(out)


def expected(data: bytes, offset: int, length: int) -> bytes:
    """What a read returns: the file's bytes, zeros past what was written."""
    got = data[offset : offset + length]
    return got + bytes(length - len(got))


EDGES = [
    (0, 1),
    (0, BLOCK),
    (BLOCK - 1, 2),  # across a block edge
    (BLOCK, BLOCK),
    (CS - 1, 1),  # the last byte of chunk 0
    (CS - 1, 2),  # across a chunk edge
    (CS, 1),  # the first byte of chunk 1
    (CS - 100, 2 * CS + 200),  # three chunks, the middle one whole
    (0, 3 * CS + CS // 2),  # everything
    (3 * CS + CS // 2 - 10, 100),  # past the end of what was written: zeros
    (5 * CS, 10),  # a chunk never written: a hole
]


async def test_reads_at_chunk_and_block_edges(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = os.urandom(3 * CS + CS // 2)
    await storage.writes.write(INO, layout, 0, data)
    for offset, length in EDGES:
        assert await read(storage, [(INO, layout, offset, length)]) == expected(
            data, offset, length
        ), (offset, length)
    # all of them in one batch, laid end to end
    batch = [(INO, layout, o, n) for o, n in EDGES]
    assert await read(storage, batch) == b"".join(expected(data, o, n) for o, n in EDGES)


async def test_unusable_local_target_falls_back_to_the_daemon(cluster: ChainCluster) -> None:
    """The daemons run in this process, whose LMDB environments cannot be
    opened twice: the short circuit must give up on them (not fail) and the
    daemons serve. (The short circuit itself: tests/e2e/test_local_reads.py.)"""
    storage = storage_client(cluster, local_reads=True)
    layout = layout_of(cluster)
    data = os.urandom(2 * CS)
    await storage.writes.write(INO, layout, 0, data)
    batch = [(INO, layout, o, n) for o, n in EDGES[:8]]
    want = b"".join(expected(data, o, n) for o, n in EDGES[:8])
    assert await read(storage, batch) == want
    routing = cluster.routing.current
    local = storage.replicas.local_targets(routing)
    assert local and all(storage.local.target(routing, t) is None for t in local)
    out = bytearray(len(want))
    assert storage.reads.read_local_now(plan(batch), memoryview(out)) == plan(batch)


async def test_blocking_native_path_reads_the_same_bytes(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = os.urandom(3 * CS)
    await storage.writes.write(INO, layout, 0, data)
    reader = BlockingReader(storage, cluster.secret_file.read_bytes())
    batch = [(INO, layout, o, n) for o, n in EDGES]
    out = dirty(sum(n for _, n in EDGES))
    assert await trio.to_thread.run_sync(reader.read_into, batch, memoryview(out))
    assert bytes(out) == b"".join(expected(data, o, n) for o, n in EDGES)


async def test_overwrites_and_unaligned_writes(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = bytearray(os.urandom(2 * CS))
    await storage.writes.write(INO, layout, 0, data)
    assert await read(storage, [(INO, layout, 0, 2 * CS)]) == data
    patch = os.urandom(BLOCK + 3)
    at = CS - BLOCK // 2  # across the chunk edge, off the block grid
    await storage.writes.write(INO, layout, at, patch)
    data[at : at + len(patch)] = patch
    assert await read(storage, [(INO, layout, 0, 2 * CS)]) == data


def far_away(routing: Routing, local_node: int) -> Routing:
    """The same map with every node but *local_node* on another host."""
    info = copy.deepcopy(routing.info)
    for node in info["nodes"]:
        if node["id"] != local_node:
            node["host"] = "another-host"
    return Routing(info)


async def test_replica_choice_load_locality_failures(cluster: ChainCluster) -> None:
    real = cluster.routing.current
    chain = cluster.chain_ids()[0]
    targets = [t["id"] for t in real.serving_targets(chain)]
    assert len(targets) == 3
    local = targets[1]
    routing = far_away(real, real.node_of_target(local)["id"])
    replicas = Replicas(cluster.routing)
    assert replicas.local_targets(routing) & set(targets) == {local}

    assert replicas.pick(routing, chain)["id"] == local  # locality
    replicas.outstanding[local] = REMOTE_PENALTY + 1
    assert replicas.pick(routing, chain)["id"] != local  # load beats locality
    replicas.outstanding[local] = REMOTE_PENALTY - 1
    assert replicas.pick(routing, chain)["id"] == local  # ...only when it is bigger
    replicas.outstanding.clear()

    replicas.failed(routing, local, FsError(errno.EIO, "checksum"))
    assert replicas.pick(routing, chain)["id"] != local  # a failed replica is avoided
    remote = [t for t in targets if t != local]
    assert replicas.pick(routing, chain, avoid={remote[0]})["id"] == remote[1]
    # nothing healthy left: still an answer, never one this read already tried
    assert replicas.pick(routing, chain, avoid=set(remote))["id"] == local

    # few pieces of a chain: one request; many: dealt over the equal replicas
    pieces = [p for p in plan([(INO, layout_of(cluster), 0, 40 * CS)]) if p[0] == chain]
    assert len(pieces) >= SPREAD_THRESHOLD
    replicas = Replicas(cluster.routing)
    replicas.host = "yet-another-host"  # every replica equally far
    assert len(replicas.assign(real, pieces[: SPREAD_THRESHOLD - 1])) == 1
    groups = replicas.assign(real, pieces)
    assert sorted(groups) == sorted(real.target_address(t) for t in targets)
    assert sorted(p for items in groups.values() for p, _ in items) == sorted(pieces)


async def test_a_chunk_is_read_from_its_home_replica_in_every_process(
    cluster: ChainCluster,
) -> None:
    """Among equally good replicas a chunk always goes to the same one, in
    every process (so its host's page cache serves it next time), while
    different chunks spread over all of them, alone or in a batch; load
    still comes first."""
    real = cluster.routing.current
    chain = cluster.chain_ids()[0]
    targets = [t["id"] for t in real.serving_targets(chain)]
    layout: Layout = {"chunk_size": CS, "chains": [chain]}
    pieces = plan([(INO, layout, 0, 60 * CS)])
    readers = [Replicas(cluster.routing) for _ in range(3)]
    for r in readers:
        r.host = "a-reader-host"  # every replica equally far
    for r in readers[1:]:
        r._salt = readers[0]._salt + 1  # as two processes differ

    def home(r: Replicas, piece: Piece) -> int:
        return r.pick(real, chain, chunk=piece[1])["id"]

    homes = [home(readers[0], p) for p in pieces]
    assert all(home(r, p) == h for r in readers[1:] for p, h in zip(pieces, homes, strict=True))
    assert set(homes) == set(targets)  # different chunks, different homes
    for r in readers:  # a batch: every piece to its home
        placed = {p: tid for items in r.assign(real, pieces).values() for p, tid in items}
        assert [placed[p] for p in pieces] == homes
    busy = homes[0]
    readers[0].outstanding[busy] = 3
    assert home(readers[0], pieces[0]) != busy  # load beats the home


async def test_read_fails_over_a_killed_replica(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout: Layout = {"chunk_size": CS, "chains": [cluster.chain_ids()[0]]}
    data = os.urandom(2 * CS)
    await storage.writes.write(INO, layout, 0, data)
    routing = cluster.routing.current
    targets = [t["id"] for t in routing.serving_targets(layout["chains"][0])]
    victim = targets[0]
    await cluster.stop_node(cluster.node_of(victim), clean=False)  # mgmtd is not told
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 100  # so the dead one is asked first
    assert await read(storage, [(INO, layout, 0, 2 * CS)]) == data
    assert victim in storage.replicas.suspect
    assert storage.replicas.outstanding[victim] == 0  # every request accounted for


async def test_write_retries_on_the_new_head(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout: Layout = {"chunk_size": CS, "chains": [cluster.chain_ids()[0]]}
    head = cluster.routing.current.serving_targets(layout["chains"][0])[0]["id"]
    await cluster.stop_node(cluster.node_of(head), clean=False)
    data = os.urandom(CS + 10)
    with trio.fail_after(20):
        # the head refuses; the client reports it, mgmtd (which cannot reach
        # it either) takes it out, and the write goes to the new head
        await storage.writes.write(INO, layout, 0, data)
    serving = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    assert head not in serving and len(serving) == 2
    assert await read(storage, [(INO, layout, 0, CS + 10)]) == data


async def test_checksum_failure_reads_another_replica(cluster: ChainCluster) -> None:
    storage = storage_client(cluster, local_reads=False)
    layout: Layout = {"chunk_size": CS, "chains": [cluster.chain_ids()[0]]}
    data = os.urandom(CS)
    await storage.writes.write(INO, layout, 0, data)
    cid = chunk_id(INO, 0)
    targets = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    damaged = targets[0]
    flip(cluster.chunk_file(damaged, cid), 1000)
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 100  # so the damaged one is asked first
    assert await read(storage, [(INO, layout, 0, CS)]) == data  # never the damaged bytes
    assert damaged in storage.replicas.suspect


# ---- coalesced reads (client/read_batcher.py) ----------------------------------

SIZE = 3 * CS + CS // 2
EDGE_OFFSETS = [0, 1, BLOCK - 1, BLOCK, CS - 1, CS, 2 * CS - BLOCK, SIZE - 1, SIZE, 4 * CS]


async def read_all(
    storage: StorageClient, ranges: list[tuple[int, int]], layout: Layout
) -> list[bytes]:
    """Every range as its own read, all at once (so they meet in the batcher)."""
    got: list[bytes] = [b""] * len(ranges)

    async def one(i: int, offset: int, length: int) -> None:
        got[i] = await read(storage, [(INO, layout, offset, length)])

    async with trio.open_nursery() as nursery:
        for i, (offset, length) in enumerate(ranges):
            nursery.start_soon(one, i, offset, length)
    return got


def test_split_reply_gives_each_read_its_own_share() -> None:
    _check_split()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(st.integers(0, 5000), st.sampled_from([-errno.EIO, -errno.EINVAL])),
            max_size=6,
        ),
        min_size=1,
        max_size=12,
    )
)
def test_split_reply_model(per_read: list[list[int]]) -> None:
    """Against a model: each read's lengths are its own items', and its bytes
    the payload's run of its delivered bytes, whatever the others got."""
    _check_split(per_read)


def _check_split(per_read: list[list[int]] | None = None) -> None:
    per_read = (
        per_read if per_read is not None else [[5, -errno.EIO, 0], [3], [], [-errno.EINVAL, 7]]
    )
    waiters = [
        QueuedRead([(1, b"c" * 12, 0, max(n, 0)) for n in lengths], 1.0, 0) for lengths in per_read
    ]
    blobs = [os.urandom(n) for lengths in per_read for n in lengths if n > 0]
    payload = b"".join(blobs)
    split_reply(waiters, [n for lengths in per_read for n in lengths], memoryview(payload))
    pos = 0
    for w, lengths in zip(waiters, per_read, strict=True):
        assert w.result is not None
        got_lengths, got = w.result
        n = sum(x for x in lengths if x > 0)
        assert got_lengths == lengths and bytes(got) == payload[pos : pos + n]
        pos += n


async def test_coalesced_reads_return_exactly_their_bytes(cluster: ChainCluster) -> None:
    """Many reads at chunk and block edges (and random ones) in flight at
    once: coalesced into shared frames, each gets exactly its own bytes."""
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = os.urandom(SIZE)
    await storage.writes.write(INO, layout, 0, data)
    rng = random.Random(7)
    batcher = storage.reads.batcher
    for _ in range(4):
        ranges = [
            (
                rng.choice(EDGE_OFFSETS) if rng.random() < 0.5 else rng.randrange(4 * CS),
                rng.choice([1, 2, BLOCK - 1, BLOCK, BLOCK + 1, CS])
                if rng.random() < 0.5
                else rng.randrange(1, 2 * CS),
            )
            for _ in range(48)
        ]
        frames, reads = batcher.frames_sent, batcher.reads_sent
        got = await read_all(storage, ranges, layout)
        for (offset, length), bytes_read in zip(ranges, got, strict=True):
            assert bytes_read == expected(data, offset, length), (offset, length)
        assert batcher.frames_sent - frames < batcher.reads_sent - reads  # some coalesced


async def test_many_readers_share_frames(cluster: ChainCluster) -> None:
    """Thirty-two 4 KiB-ish reads in flight at once go out in far fewer frames
    than reads, each answered with its own bytes."""
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = os.urandom(SIZE)
    await storage.writes.write(INO, layout, 0, data)
    ranges = [((i * 7919) % (SIZE - 600), 600) for i in range(32)]
    batcher = storage.reads.batcher
    frames0, reads0 = batcher.frames_sent, batcher.reads_sent
    got = await read_all(storage, ranges, layout)
    assert got == [expected(data, o, n) for o, n in ranges]
    assert batcher.reads_sent - reads0 == 32
    assert batcher.frames_sent - frames0 < 32 // 2  # coalesced, not one frame per read


async def test_damaged_replica_inside_a_coalesced_frame(cluster: ChainCluster) -> None:
    """One chunk damaged on the replica every read goes to first: the reads
    of it fail over to another replica, those coalesced with them in the same
    frames are served as usual; no read ever returns the damaged bytes."""
    storage = storage_client(cluster, local_reads=False)
    layout: Layout = {"chunk_size": CS, "chains": [cluster.chain_ids()[0]]}
    data = os.urandom(2 * CS)
    await storage.writes.write(INO, layout, 0, data)
    targets = [t["id"] for t in cluster.routing.current.serving_targets(layout["chains"][0])]
    damaged = targets[0]
    cid = chunk_id(INO, 0)
    flip(cluster.chunk_file(damaged, cid), 3 * BLOCK + 5)
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 1000  # so the damaged one is asked first
    ranges = [(3 * BLOCK, BLOCK), (CS + 100, 300), (0, CS), (CS, BLOCK), (3 * BLOCK + 5, 1)] * 3
    got = await read_all(storage, ranges, layout)
    assert got == [expected(data, o, n) for o, n in ranges]
    assert damaged in storage.replicas.suspect


async def test_a_refused_coalesced_frame_is_resent_read_by_read(cluster: ChainCluster) -> None:
    """A frame refused as a whole (here: past the daemon's reply limit only
    because reads were coalesced) is not any one read's fault: each read is
    sent again alone and gets its own answer."""
    chain = cluster.chain_ids()[0]
    cid = chunk_id(INO + 1, 0)
    data = os.urandom(CS)
    await cluster.write(chain, cid, 0, data)
    target = cluster.members(chain)[0]
    address = cluster.routing.current.target_address(target)
    cluster.node_of(target).service.max_read_bytes = CS + CS // 2  # one read fits, not two
    batcher = ReadBatcher(cluster.rpc, 5.0)
    got: list[tuple[list[int], bytes]] = []

    async def one() -> None:
        lengths, payload = await batcher.read(address, [(target, cid, 0, CS)], 5.0)
        got.append((lengths, bytes(payload)))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert got == [([CS], data)] * 3
    # the first alone, the other two coalesced and refused, then each alone
    assert batcher.frames_sent == 4


async def test_a_silent_node_fails_the_frame_and_its_queue(cluster: ChainCluster) -> None:
    """Reads queued behind a frame to a node that stops answering fail with
    that frame (at once, for the engine to retry elsewhere) instead of each
    waiting out its own timeout after it."""
    chain = cluster.chain_ids()[0]
    cid = chunk_id(INO + 2, 0)
    await cluster.write(chain, cid, 0, b"x" * 100)
    target = cluster.members(chain)[0]
    address = cluster.routing.current.target_address(target)
    store = cluster.node_of(target).store(target)
    real_read = store.read

    def stuck(cid: bytes, offset: int, length: int) -> memoryview:
        time.sleep(1.0)  # a disk that stopped answering (in the daemon's io thread)
        return real_read(cid, offset, length)

    batcher = ReadBatcher(cluster.rpc, 0.3)
    errors: list[int] = []

    async def one() -> None:
        try:
            await batcher.read(address, [(target, cid, 0, 10)], 0.3)
        except FsError as exc:
            errors.append(exc.errno)

    store.read_nowait = lambda *args: None  # type: ignore[method-assign]
    # not through io_uring either: every cold read goes to `read`
    store.read_plan = lambda *args, **kwargs: None  # type: ignore[method-assign]
    store.read = stuck  # type: ignore[method-assign]
    try:
        with trio.fail_after(2):  # not 5 x 0.3 s one after another
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(one)
    finally:
        del store.read_nowait, store.read_plan, store.read
    assert errors == [errno.ETIMEDOUT] * 5
    assert batcher.frames_sent == 1
    await trio.sleep(1.0)  # the stuck io thread finishes


async def test_blocking_path_receives_big_reads_in_place(cluster: ChainCluster) -> None:
    """Big pieces land straight in the caller's buffer (no reply buffer, no
    copy): whole chunks, a short one past the end (zeros after it), a hole,
    unaligned starts; and the bytes are exactly the file's."""
    storage = storage_client(cluster, local_reads=False)
    layout = layout_of(cluster)
    data = os.urandom(3 * CS + 1000)
    await storage.writes.write(INO, layout, 0, data)
    reader = BlockingReader(storage, cluster.secret_file.read_bytes())
    ranges = [(0, CS), (CS + 7, CS - 7), (3 * CS, CS), (2 * CS + 3, 40000), (6 * CS, CS)]
    out = dirty(sum(n for _, n in ranges))
    extents = [(INO, layout, o, n) for o, n in ranges]
    assert await trio.to_thread.run_sync(reader.read_into, extents, memoryview(out))
    assert bytes(out) == b"".join(expected(data, o, n) for o, n in ranges)
    pieces = plan(extents)
    placed = [(p, 1) for p in pieces]
    lengths = [min(p[3], 100) for p in pieces]
    target = memoryview(bytearray(b"\xff" * len(out)))
    views = landing_views(placed, lengths, sum(lengths), target)
    assert views is not None and [len(v) for v in views] == lengths
    assert landing_views(placed, lengths, sum(lengths) + 1, target) is None
    assert bytes(target[pieces[0][4] + 100 : pieces[0][4] + pieces[0][3]]) == bytes(
        pieces[0][3] - 100
    )


class RecordingLocal:
    """Stands in for LocalReads: records whether a read may wait for the disk."""

    enabled = True

    def __init__(self) -> None:
        self.waits: list[bool] = []

    def read_pieces(self, pieces: list[object], out: memoryview, wait: bool) -> list[object]:
        self.waits.append(wait)
        return pieces


def test_a_mount_never_waits_for_the_disk_on_its_loop() -> None:
    """A lone cold local read waits for the disk inline in the native client
    (a thread hop costs more), never in a FUSE mount, whose one loop would
    hold every READ queued behind it in the kernel (`inline_disk_waits`)."""
    piece = (0, b"\0" * 16, 0, 10, 0)
    for inline in (True, False):
        local = RecordingLocal()
        engine = ReadEngine(
            None,  # type: ignore[arg-type]  # (no call goes out)
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            local,  # type: ignore[arg-type]
            timeout=1.0,
            retry_budget=1.0,
            inline_disk_waits=inline,
        )
        engine.read_local_now([piece], memoryview(bytearray(10)))  # type: ignore[list-item]
        assert local.waits == [inline]
