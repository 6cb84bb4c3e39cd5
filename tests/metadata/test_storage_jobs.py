"""The metadata server's storage jobs against a real replicated chain: real
storage daemons and a real mgmtd in this process (tests/chains.py). A shrink
and a garbage collection go to the chain's head and reach every replica; a
chain without a serving target makes the job wait; replicas that were away
are made consistent by resync when they return."""

from __future__ import annotations

import errno
import stat
from pathlib import Path
from typing import Any

import pytest
import trio
from clusters import CS, ChainCluster, eventually

from shufflefs.metadata.gc import GC_BATCH, StorageJobs
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.writer import Writer
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import StorageStub, chunk_id


def storage_jobs(cluster: ChainCluster, ns: NamespaceStore) -> StorageJobs:
    return StorageJobs(
        ns,
        Writer(ns.txns),
        lambda: cluster.routing.current,
        cluster.rpc,
        refresh_routing=cluster.routing.refresh,
        base_delay=0.0,  # every pass retries every job: the tests run the passes
    )


async def test_freed_files_are_removed_in_batches(
    cluster: ChainCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many freed files: one `remove_files` per chain and batch (not a call
    per file and chain), every replica emptied of them, one commit of the
    jobs; a storage daemon without the batch call gets them one by one."""
    [chain] = cluster.chain_ids()
    ns = NamespaceStore(tmp_path / "ns", map_size=64 << 20, sync=False)
    calls: list[tuple[str, int]] = []
    for method in ("remove_file", "remove_files"):
        real = getattr(StorageStub, method)

        async def counted(self: StorageStub, *args: Any, _r: Any = real, _m: str = method) -> int:
            calls.append((_m, len(args[3]) if _m == "remove_files" else 1))
            return int(await _r(self, *args))

        monkeypatch.setattr(StorageStub, method, counted)
    try:
        jobs = storage_jobs(cluster, ns)
        layout = {"chunk_size": CS, "chains": [chain]}
        n = GC_BATCH + 20
        inos = [
            ns.mknod(ROOT_INODE, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0, 0, lambda: layout)["ino"]
            for i in range(n)
        ]
        keep = inos.pop()
        for ino in [*inos, keep]:
            await cluster.write(chain, chunk_id(ino, 0), 0, b"x" * 100)
        for i in range(n - 1):
            ns.unlink(ROOT_INODE, b"f%d" % i)
        await jobs.run_once()
        assert ns.gc_jobs() == []
        assert sorted(calls) == [("remove_files", 20 - 1), ("remove_files", GC_BATCH)]
        state = await cluster.assert_identical(chain)
        assert list(state) == [chunk_id(keep, 0)]

        # a chain of the batch fails (here: one the routing map does not
        # know, retried for a second): its files wait, the batch's others are done
        jobs.retry_budget = 1.0
        broken = {"chunk_size": CS, "chains": [chain, 999]}
        more = {
            name: ns.mknod(ROOT_INODE, name, stat.S_IFREG | 0o644, 0, 0, 0, lambda lay=lay: lay)[
                "ino"
            ]
            for name, lay in ((b"g0", layout), (b"g1", broken), (b"g2", layout), (b"g3", broken))
        }
        for name in more:
            ns.unlink(ROOT_INODE, name)
        await jobs.run_once()
        assert sorted(j["ino"] for j in ns.gc_jobs()) == sorted([more[b"g1"], more[b"g3"]])
        for name in more:  # (the remaining ones, layouts made whole, for what follows)
            ns.gc_done(more[name])

        async def unknown(self: StorageStub, *args: Any) -> int:
            raise FsError(errno.ENOSYS, "unknown method 'remove_files'")

        monkeypatch.setattr(StorageStub, "remove_files", unknown)
        calls.clear()
        ns.unlink(ROOT_INODE, b"f%d" % (n - 1))
        await jobs.run_once()
        assert ns.gc_jobs() == [] and calls == [("remove_file", 1)]
        assert await cluster.assert_identical(chain) == {}
    finally:
        ns.close()


async def test_shrink_and_gc_reach_every_replica(cluster: ChainCluster, tmp_path: Path) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    ns = NamespaceStore(tmp_path / "ns", map_size=64 << 20, sync=False)
    try:
        jobs = storage_jobs(cluster, ns)
        layout = {"chunk_size": CS, "chains": [chain]}
        ino = ns.mknod(ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0, 0, lambda: layout)["ino"]
        keep = ns.mknod(ROOT_INODE, b"g", stat.S_IFREG | 0o644, 0, 0, 0, lambda: layout)["ino"]
        for idx in range(4):
            await cluster.write(chain, chunk_id(ino, idx), 0, bytes([idx + 1]) * CS)
        await cluster.write(chain, chunk_id(keep, 0), 0, b"kept")
        ns.update_length(ino, 4 * CS)
        ns.setattr(ino, size=CS + 100)  # commits the size and a truncate job
        await jobs.truncate_now(ino)
        assert ns.truncate_job(ino) is None
        state = await cluster.assert_identical(chain)
        assert {c: v[:2] for c, v in state.items() if c[:8] == ino.to_bytes(8, "big")} == {
            chunk_id(ino, 0): (1, CS),
            chunk_id(ino, 1): (2, 100),
        }
        # the middle and the tail go away; the head alone still takes the removal
        away = [cluster.node_of(middle), cluster.node_of(tail)]
        for node in away:
            await cluster.stop_node(node)
        await cluster.sync_maps()
        ns.unlink(ROOT_INODE, b"f")  # freed: a GC job
        assert [j["ino"] for j in ns.gc_jobs()] == [ino]
        await jobs.run_once()
        assert ns.gc_jobs() == []
        assert list(await cluster.replica_state(head)) == [chunk_id(keep, 0)]
        # no serving target at all: the job waits, nobody is called
        head_node = cluster.node_of(head)
        await cluster.stop_node(head_node)
        await cluster.routing.refresh()
        assert cluster.routing.current.serving_targets(chain) == []
        ns.unlink(ROOT_INODE, b"g")
        await jobs.run_once()
        assert [j["ino"] for j in ns.gc_jobs()] == [keep]
        # the last serving target returns and serves at once; the job is done
        await cluster.start_node(head_node)
        await cluster.sync_maps()
        await jobs.run_once()
        assert ns.gc_jobs() == []
        assert await cluster.replica_state(head) == {}
        # the others come back, still holding the removed chunks: resync drops them
        for node in away:
            await cluster.start_node(node)
        mgmtd = cluster.state
        assert mgmtd is not None
        await eventually(
            lambda: all(mgmtd.targets[t].state == "serving" for t in (middle, tail)), timeout=30
        )
        await cluster.sync_maps()
        assert sorted(cluster.members(chain)) == sorted([head, middle, tail])
        assert await cluster.assert_identical(chain) == {}
    finally:
        ns.close()


async def test_shrink_rides_through_a_crashed_head(cluster: ChainCluster, tmp_path: Path) -> None:
    """The head dies without a word to mgmtd (its map still lists it): the
    truncate in the reply path reports it, mgmtd takes it out, and the cut
    is made on the new chain instead of answering EIO."""
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    ns = NamespaceStore(tmp_path / "ns", map_size=64 << 20, sync=False)
    try:
        jobs = storage_jobs(cluster, ns)
        jobs.attach(cluster.routing)
        layout = {"chunk_size": CS, "chains": [chain]}
        ino = ns.mknod(ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0, 0, lambda: layout)["ino"]
        for idx in range(3):
            await cluster.write(chain, chunk_id(ino, idx), 0, bytes([idx + 1]) * CS)
        ns.update_length(ino, 3 * CS)
        await cluster.stop_node(cluster.node_of(head), clean=False)
        assert cluster.members(chain)[0] == head  # nobody told mgmtd
        ns.setattr(ino, size=100)
        with trio.fail_after(20):
            await jobs.truncate_now(ino)
        assert ns.truncate_job(ino) is None
        assert cluster.members(chain) == [middle, tail]
        for target in (middle, tail):
            state = await cluster.replica_state(target)
            assert {c: v[:2] for c, v in state.items()} == {chunk_id(ino, 0): (2, 100)}
    finally:
        ns.close()


async def test_a_late_cut_never_lands_after_new_writes(
    cluster: ChainCluster, tmp_path: Path
) -> None:
    """A background pass that listed a truncate job before the reply path
    carried it out must not cut again afterwards: the file has been written
    past the cut since (the bytes would vanish)."""
    [chain] = cluster.chain_ids()
    ns = NamespaceStore(tmp_path / "ns", map_size=64 << 20, sync=False)
    try:
        jobs = storage_jobs(cluster, ns)
        layout = {"chunk_size": CS, "chains": [chain]}
        ino = ns.mknod(ROOT_INODE, b"f", stat.S_IFREG | 0o644, 0, 0, 0, lambda: layout)["ino"]
        await cluster.write(chain, chunk_id(ino, 0), 0, b"a" * CS)
        ns.update_length(ino, CS)
        ns.setattr(ino, size=10)
        listed = ns.truncate_jobs()  # what a background pass saw
        await jobs.truncate_now(ino)
        await cluster.write(chain, chunk_id(ino, 0), 10, b"b" * 100)  # written after the cut
        await jobs._truncate(listed[0])
        [target] = cluster.members(chain)[:1]
        state = await cluster.replica_state(target)
        assert state[chunk_id(ino, 0)][1] == 110
    finally:
        ns.close()
