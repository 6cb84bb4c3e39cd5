"""mgmtd's state machine: registration, chains, heartbeats, expiry."""

from __future__ import annotations

import errno

import pytest

from shufflefs.cluster.protocol import ClusterConfig, TargetRegistration
from shufflefs.cluster.state import ClusterState
from shufflefs.rpc.errors import FsError


def config(replicas: int = 1) -> ClusterConfig:
    return ClusterConfig(
        chunk_size=1 << 20,
        stripe=16,
        replicas=replicas,
        heartbeat_interval=1.0,
        heartbeat_timeout=10.0,
    )


def targets(n: int, base: str = "/t") -> list[TargetRegistration]:
    return [
        TargetRegistration(target_id=None, path=f"{base}{i}", capacity=100, free=50, device=i + 1)
        for i in range(n)
    ]


def test_storage_registration_makes_chains_r1() -> None:
    s = ClusterState.new(config())
    v0 = s.version
    r = s.register(None, "storage", "127.0.0.1:1", "h1", 10, None, targets(2), now=0)
    assert r["cluster_id"] == s.cluster_id and len(r["target_ids"]) == 2
    assert s.version > v0
    assert sorted(c.targets[0] for c in s.chains.values()) == sorted(r["target_ids"])
    again = s.register(
        s.cluster_id,
        "storage",
        "127.0.0.1:1",
        "h1",
        11,
        r["node_id"],
        [
            TargetRegistration(target_id=t, path=f"/t{i}", capacity=100, free=50, device=i + 1)
            for i, t in enumerate(r["target_ids"])
        ],
        now=1,
    )
    assert again["node_id"] == r["node_id"] and again["target_ids"] == r["target_ids"]
    assert len(s.chains) == 2  # no new chains for known targets


def test_chains_on_distinct_nodes_r3() -> None:
    s = ClusterState.new(config(replicas=3))
    ids = []
    for i in range(4):
        r = s.register(None, "storage", f"127.0.0.1:{i + 1}", f"h{i}", i, None, targets(2), now=0)
        ids.append(r["node_id"])
    assert len(s.chains) == 2  # 8 targets / 3, limited by distinct nodes per chain
    for chain in s.chains.values():
        nodes = {s.targets[t].node for t in chain.targets}
        assert len(nodes) == 3


def test_wrong_cluster_refused() -> None:
    s = ClusterState.new(config())
    with pytest.raises(FsError) as info:
        s.register("someone-else", "storage", "127.0.0.1:1", "h", 1, None, [], now=0)
    assert info.value.errno == errno.EINVAL


def test_bad_kind_and_target_ownership() -> None:
    s = ClusterState.new(config())
    with pytest.raises(FsError):
        s.register(None, "mgmtd", "127.0.0.1:1", "h", 1, None, [], now=0)
    with pytest.raises(FsError):
        s.register(None, "meta", "127.0.0.1:1", "h", 1, None, targets(1), now=0)
    a = s.register(None, "storage", "127.0.0.1:1", "h", 1, None, targets(1), now=0)
    b = s.register(None, "storage", "127.0.0.1:2", "h", 2, None, [], now=0)
    stolen = [
        TargetRegistration(target_id=a["target_ids"][0], path="/x", capacity=1, free=1, device=1)
    ]
    with pytest.raises(FsError) as info:
        s.register(None, "storage", "127.0.0.1:2", "h", 2, b["node_id"], stolen, now=0)
    assert info.value.errno == errno.EINVAL


def test_heartbeat_expiry_and_reregistration() -> None:
    s = ClusterState.new(config())
    r = s.register(None, "storage", "127.0.0.1:1", "h", 7, None, targets(1), now=100)
    node = r["node_id"]
    tid = r["target_ids"][0]
    assert s.heartbeat(
        node,
        7,
        [{"target_id": tid, "capacity": 9, "free": 8, "used": 1, "chunks": 1, "device": 1}],
        now=105,
    )
    assert s.targets[tid].used == 1
    assert s.expire(now=110) == []
    v = s.version
    assert s.expire(now=116) == [node]
    assert s.version > v and s.nodes[node].state == "offline" and s.targets[tid].state == "offline"
    with pytest.raises(FsError) as info:
        s.heartbeat(node, 7, [], now=117)
    assert info.value.errno == errno.ENOENT
    s.register(
        s.cluster_id,
        "storage",
        "127.0.0.1:1",
        "h",
        7,
        node,
        [TargetRegistration(target_id=tid, path="/t0", capacity=1, free=1, device=1)],
        now=118,
    )
    assert s.nodes[node].state == "online" and s.targets[tid].state == "serving"
    with pytest.raises(FsError):
        s.heartbeat(12345, 1, [], now=0)


def test_persistence_round_trip() -> None:
    s = ClusterState.new(config())
    s.register_self("127.0.0.1:9", "h", 1, now=0)
    s.register(None, "meta", "127.0.0.1:2", "h", 2, None, [], now=0)
    s.register(None, "storage", "127.0.0.1:3", "h", 3, None, targets(2), now=0)
    t = ClusterState.from_record(s.to_record(), now=50)
    assert t.routing()["nodes"] == [dict(n, last_seen=50) for n in s.routing()["nodes"]]
    assert t.routing()["chains"] == s.routing()["chains"]
    assert t.version == s.version and t.cluster_id == s.cluster_id


def test_capacity_counts_serving_targets() -> None:
    s = ClusterState.new(config())
    s.register(None, "storage", "127.0.0.1:3", "h", 3, None, targets(2), now=0)
    assert s.capacity() == {"capacity": 200, "free": 100, "used": 0}


def test_capacity_counts_a_shared_filesystem_once() -> None:
    s = ClusterState.new(config())
    same_disk = [
        TargetRegistration(target_id=None, path=f"/t{i}", capacity=100, free=50, device=7)
        for i in range(3)
    ]
    s.register(None, "storage", "127.0.0.1:3", "h", 3, None, same_disk, now=0)
    s.register(None, "storage", "127.0.0.1:4", "other-host", 4, None, targets(1), now=0)
    assert s.capacity()["capacity"] == 200 and s.capacity()["free"] == 100
