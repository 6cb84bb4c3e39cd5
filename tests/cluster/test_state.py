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
        min_replicas=min(2, replicas),
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


def three_nodes(replicas: int = 3) -> tuple[ClusterState, list[dict[str, int]]]:
    s = ClusterState.new(config(replicas=replicas))
    regs = []
    for i in range(3):
        r = s.register(
            None, "storage", f"127.0.0.1:{i + 1}", f"h{i}", 100 + i, None, targets(1), now=0
        )
        regs.append({"node": r["node_id"], "target": r["target_ids"][0], "pid": 100 + i})
    return s, regs


def reregister(s: ClusterState, reg: dict[str, int], now: float, pid: int | None = None) -> None:
    s.register(
        s.cluster_id,
        "storage",
        f"127.0.0.1:{reg['node']}",
        "h",
        pid or reg["pid"],
        reg["node"],
        [TargetRegistration(target_id=reg["target"], path="/t", capacity=100, free=50, device=9)],
        now=now,
    )


def chain_states(s: ClusterState) -> list[tuple[int, str]]:
    (chain,) = s.chains.values()
    return [(t, s.targets[t].state) for t in chain.targets]


def test_failed_target_leaves_and_rejoins_at_tail_after_sync() -> None:
    s, regs = three_nodes()
    (chain,) = s.chains.values()
    head = chain.targets[0]
    head_reg = next(r for r in regs if r["target"] == head)
    v = chain.version
    for r in regs:
        if r is not head_reg:
            s.heartbeat(r["node"], r["pid"], [], now=20)
    assert s.expire(now=20) == [head_reg["node"]]
    assert chain.version > v and chain.targets[-1] == head
    assert [st for _, st in chain_states(s)] == ["serving", "serving", "offline"]
    reregister(s, head_reg, now=21, pid=999)
    assert chain_states(s)[-1] == (head, "syncing")
    with pytest.raises(FsError) as info:
        s.sync_done(head, chain.id, chain.version - 1)
    assert info.value.errno == errno.ESTALE
    s.sync_done(head, chain.id, chain.version)
    assert [st for _, st in chain_states(s)] == ["serving"] * 3 and chain.targets[-1] == head


def test_quick_restart_keeps_serving() -> None:
    s, regs = three_nodes()
    (chain,) = s.chains.values()
    order = list(chain.targets)
    reregister(s, regs[1], now=1, pid=555)  # restarted before the timeout: never cut out
    assert chain.targets == order and all(st == "serving" for _, st in chain_states(s))


def test_last_serving_target_must_return_first() -> None:
    s, regs = three_nodes()
    (chain,) = s.chains.values()
    t = 0.0
    alive = list(regs)
    order_of_death = []
    while alive:  # kill one node at a time
        dying = alive.pop(0)
        order_of_death.append(dying)
        t += 20
        for r in alive:
            s.heartbeat(r["node"], r["pid"], [], now=t)
        s.expire(now=t)
    last = order_of_death[-1]["target"]
    assert chain.last_serving == last
    first_dead = order_of_death[0]
    reregister(s, first_dead, now=t + 1, pid=1)
    assert dict(chain_states(s))[first_dead["target"]] == "waiting"  # stale: may not serve
    reregister(s, order_of_death[-1], now=t + 2, pid=2)
    states = dict(chain_states(s))
    assert states[last] == "serving" and states[first_dead["target"]] == "syncing"
    assert chain.last_serving is None


def test_mark_offline_by_report() -> None:
    s, regs = three_nodes()
    assert s.mark_offline(regs[0]["node"], "unreachable from node 2")
    assert s.targets[regs[0]["target"]].state == "offline"
    assert not s.mark_offline(regs[0]["node"], "again")


def test_writable_chains_prefer_healthy_then_min_replicas() -> None:
    from shufflefs.cluster.routing import Routing

    s = ClusterState.new(config(replicas=2))
    regs = []
    for i in range(4):
        r = s.register(None, "storage", f"127.0.0.1:{i + 1}", f"h{i}", i, None, targets(1), now=0)
        regs.append(r)
    assert len(s.chains) == 2
    r = Routing(s.routing())
    assert r.writable_chains() == sorted(s.chains)
    victim = next(iter(s.chains.values())).targets[0]
    s.mark_offline(s.targets[victim].node, "test")
    r = Routing(s.routing())
    healthy = [c.id for c in s.chains.values() if victim not in c.targets]
    assert r.writable_chains() == healthy  # healthy chains first
    for c in healthy:
        s.mark_offline(s.targets[s.chains[c].targets[0]].node, "test")
    assert Routing(s.routing()).writable_chains() == []  # min_replicas 2: none left
    assert [t["id"] for t in Routing(s.routing()).write_targets(next(iter(s.chains)))] != []


def add_spare(s: ClusterState, node: int, pid: int, now: float = 50) -> int:
    """Register a node with one new target (a spare: no chain has room)."""
    r = s.register(
        s.cluster_id,
        "storage",
        f"127.0.0.1:{node}",
        "h",
        pid,
        node if node in s.nodes else None,
        [TargetRegistration(target_id=None, path=f"/spare{pid}", capacity=100, free=50, device=5)],
        now=now,
    )
    return r["target_ids"][-1]


def test_assign_target_replaces_the_member_offline_longest() -> None:
    s, regs = three_nodes()
    (chain,) = s.chains.values()
    spare = add_spare(s, 40, pid=40)
    assert s.chain_of(spare) is None and s.targets[spare].state == "serving"
    # nothing is offline: no chain needs it, it stays a spare
    assert s.assign_target(spare, None) == {"chain": None, "replaced": None, "state": "serving"}
    with pytest.raises(FsError) as info:  # full, nobody to replace
        s.assign_target(spare, chain.id)
    assert info.value.errno == errno.EBUSY
    first, second = regs[0], regs[1]
    s.mark_offline(first["node"], "disk died")
    s.mark_offline(second["node"], "later")
    v = s.version
    result = s.assign_target(spare, None)
    assert result == {"chain": chain.id, "replaced": first["target"], "state": "syncing"}
    assert s.version > v
    assert first["target"] not in chain.targets
    # the tail of the write order (offline members are listed after everyone)
    assert chain_states(s) == [
        (regs[2]["target"], "serving"),
        (spare, "syncing"),
        (second["target"], "offline"),
    ]
    s.sync_done(spare, chain.id, chain.version)
    assert dict(chain_states(s))[spare] == "serving"
    with pytest.raises(FsError) as info:
        s.assign_target(spare, chain.id)
    assert info.value.errno == errno.EEXIST
    with pytest.raises(FsError) as info:
        s.assign_target(999, None)
    assert info.value.errno == errno.ENOENT
    # the replaced target's node comes back: its target is a spare now
    reregister(s, first, now=60, pid=77)
    assert s.chain_of(first["target"]) is None and s.targets[first["target"]].state == "serving"


def test_assign_target_keeps_chains_on_distinct_nodes_and_the_last_serving() -> None:
    s, regs = three_nodes()
    (chain,) = s.chains.values()
    s.mark_offline(regs[0]["node"], "gone")
    # a second target on a node that still serves in the chain may not join it
    same_node = add_spare(s, regs[1]["node"], pid=regs[1]["pid"])
    with pytest.raises(FsError) as info:
        s.assign_target(same_node, chain.id)
    assert info.value.errno == errno.EINVAL
    assert s.assign_target(same_node, None)["chain"] is None  # no chain it may join
    # every member down: the last serving one holds the only current copy
    s.mark_offline(regs[1]["node"], "gone")
    s.mark_offline(regs[2]["node"], "gone")
    last = chain.last_serving
    assert last is not None
    spare = add_spare(s, 50, pid=50)
    result = s.assign_target(spare, chain.id)
    assert result["replaced"] not in (None, last) and result["state"] == "waiting"
    assert last in chain.targets
    offline_node = add_spare(s, 60, pid=60)
    s.mark_offline(s.targets[offline_node].node, "gone")
    with pytest.raises(FsError) as info:
        s.assign_target(offline_node, None)
    assert info.value.errno == errno.EHOSTDOWN
