"""The storage side of the client (`StorageClient`: replica choice, the read
engine, the short circuit, the blocking native path, chain writes) against
three real storage daemons and a real mgmtd in this process."""

from __future__ import annotations

import copy
import errno
import os
from collections.abc import Sequence

import trio
from clusters import CS, ChainCluster
from harness import flip

from shufflefs.client.blocking_read import BlockingReader
from shufflefs.client.layout import Extent, plan
from shufflefs.client.replicas import REMOTE_PENALTY, SPREAD_THRESHOLD, Replicas
from shufflefs.client.storage_client import StorageClient
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.layout import CHUNKS_DIR, chunk_dir_name
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


async def read(storage: StorageClient, extents: Sequence[Extent]) -> bytes:
    out = bytearray(sum(e[3] for e in extents))
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
    out = bytearray(sum(n for _, n in EDGES))
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
    folder = cluster.node_of(damaged).store(damaged).path / CHUNKS_DIR / chunk_dir_name(cid)
    (chunk_file,) = [p for p in folder.iterdir() if p.name.startswith(cid.hex())]
    flip(chunk_file, 1000)
    for t in targets[1:]:
        storage.replicas.outstanding[t] += 100  # so the damaged one is asked first
    assert await read(storage, [(INO, layout, 0, CS)]) == data  # never the damaged bytes
    assert damaged in storage.replicas.suspect
