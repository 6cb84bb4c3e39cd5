"""Many targets per node: the chain table spreads each node over chains with
different partners, so a node that comes back is resynced from several
nodes at once, not from one."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import HEARTBEAT_FAST, ProcessCluster
from loadgen import content

MiB = 1 << 20
RESYNC_START = re.compile(r"resync start target=(\d+) chain=(\d+) chain_version=\d+ source=(\d+)")


@pytest.fixture
def four_by_three(tmp_path: Path) -> Iterator[ProcessCluster]:
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=4,
        replicas=3,
        targets_per_node=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    try:
        c.up()
        c.all_serving()
        yield c
    finally:
        c.down()


def test_a_returning_node_is_resynced_from_several_nodes(four_by_three: ProcessCluster) -> None:
    c = four_by_three
    status = c.status()
    node_of = {t["id"]: t["node"] for t in status["targets"]}
    chains = [[node_of[t] for t in ch["targets"]] for ch in status["chains"]]
    # 12 targets, 3 per chain: 4 chains; every node in 3, every pair of nodes in 2
    assert len(chains) == 4 and all(len(set(ch)) == 3 for ch in chains)
    nodes = sorted({n for ch in chains for n in ch})
    assert len(nodes) == 4
    for a, b in itertools.combinations(nodes, 2):
        assert sum(1 for ch in chains if a in ch and b in ch) == 2, (a, b, chains)

    first = c.mountpoint / "before.bin"
    first.write_bytes(content(1, 24 * MiB))  # 24 chunks over the 4 chains
    victim = c.storage_node_of("storage1")
    log_before = len(c.log("storage1"))
    c.kill("storage1")
    c.wait_for(
        "storage1's targets offline",
        lambda s: all(t["state"] == "offline" for t in s["targets"] if t["node"] == victim),
    )
    second = c.mountpoint / "while-away.bin"
    second.write_bytes(content(2, 16 * MiB))  # what storage1 misses
    c.restart_missing()
    c.all_serving()

    starts = RESYNC_START.findall(c.log("storage1")[log_before:])
    assert starts, "storage1 did not resync"
    sources = {node_of[int(source)] for _, _, source in starts}
    mine = {int(target) for target, _, _ in starts}
    assert mine == {t for t, n in node_of.items() if n == victim}
    assert victim not in sources
    # each of its 3 chains syncs from a partner: more than one node feeds it
    assert len(sources) >= 2, f"resynced only from {sources}"
    print(f"RECOVERY: node {victim}'s {len(mine)} targets resynced from nodes {sorted(sources)}")
    for path, seed, size in ((first, 1, 24 * MiB), (second, 2, 16 * MiB)):
        digest = hashlib.sha256(content(seed, size)).hexdigest()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
