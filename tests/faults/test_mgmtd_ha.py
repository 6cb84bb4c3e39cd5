"""The HA control plane: three mgmtd instances keep the cluster state in a
real 3-member etcd cluster and elect their primary with an etcd lease
(tests/ha_cluster.py). kill -9 of the primary: a standby takes over and the
cluster still reacts to a storage failure that happens afterwards; kill -9
of an etcd member: still serving (a restarted storage daemon is taken back
in). Standbys refuse with NOT_PRIMARY and `role` names the primary.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from ha_cluster import SECRET, EtcdCluster, HaCluster
from harness import shufflefs

from shufflefs.cluster.protocol import NOT_PRIMARY
from shufflefs.rpc import FsError, open_rpc_client


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture
def ha(etcd: EtcdCluster, tmp_path: Path) -> Iterator[HaCluster]:
    cluster = HaCluster(tmp_path / "cluster", etcd, heartbeat_interval=0.5, heartbeat_timeout=3.0)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop_all()


def test_leases_through_etcd(etcd: EtcdCluster) -> None:
    """The lease calls of the coordination interface against real etcd:
    one holder at a time, epochs rise, a lapsed lease can be granted anew."""
    from shufflefs.cluster.coordination_etcd import EtcdCoordination

    async def run() -> None:
        coord = EtcdCoordination(etcd.endpoints, "/leases-test", 2)
        async with trio.open_nursery() as nursery:
            await nursery.start(coord.campaign, "test:1")
            with trio.fail_after(10):
                await coord.elected.wait()
            a = await coord.grant_lease("meta", "m1", 2.0)
            with pytest.raises(FsError) as busy:
                await coord.grant_lease("meta", "m2", 2.0)
            assert busy.value.code == errno.EBUSY
            assert (await coord.renew_lease("meta", "m1", a["epoch"]))["epoch"] == a["epoch"]
            await coord.release_lease("meta", "m1", a["epoch"])
            b = await coord.grant_lease("meta", "m2", 2.0)
            assert b["epoch"] == a["epoch"] + 1
            with pytest.raises(FsError):
                await coord.renew_lease("meta", "m1", a["epoch"])
            # m2 stops renewing: the lease lapses in etcd and m1 gets it again
            with trio.fail_after(15):
                while await coord.get_lease("meta") is not None:
                    await trio.sleep(0.2)
            c = await coord.grant_lease("meta", "m1", 2.0)
            assert c["epoch"] == b["epoch"] + 1
            nursery.cancel_scope.cancel()

    trio.run(run)


def storage_serving(ha: HaCluster, count: int) -> bool:
    routing = ha.routing()
    serving = [t for t in routing["targets"] if t["state"] == "serving"]
    return len(serving) == count and bool(routing["chains"])


def test_primary_failover_then_a_storage_failure(ha: HaCluster) -> None:
    ha.wait_for("3 storage targets serving", lambda: storage_serving(ha, 3))

    def agreed() -> bool:
        roles = ha.roles().values()
        return len({r["primary"] if r else None for r in roles}) == 1 and None not in roles

    ha.wait_for("every mgmtd answering, agreeing on the primary", agreed)
    first = ha.primary()
    assert first is not None
    roles = ha.roles()
    assert sorted(r["role"] for r in roles.values() if r is not None) == [
        "primary",
        "standby",
        "standby",
    ]
    assert all(r is not None and r["primary"] == first for r in roles.values())

    # a standby refuses, naming the primary
    standby = next(a for a in ha.mgmtd_addresses if a != first)

    async def ask_standby() -> None:
        async with open_rpc_client(SECRET) as rpc:
            with pytest.raises(FsError) as info:
                await rpc.call(standby, "get_routing", {"known_version": -1}, timeout=2.0)
            assert info.value.code == NOT_PRIMARY and first in info.value.message

    trio.run(ask_standby)
    before = ha.routing()

    # kill -9 the primary: a standby takes over with the same cluster
    name = f"mgmtd{ha.mgmtd_addresses.index(first) + 1}"
    t0 = time.monotonic()
    ha.kill(name)
    ha.wait_for("a new primary", lambda: ha.primary() not in (None, first))
    after = ha.routing()
    stall = time.monotonic() - t0
    assert after["cluster_id"] == before["cluster_id"]
    assert {c["id"]: c["targets"] for c in after["chains"]} == {
        c["id"]: c["targets"] for c in before["chains"]
    }
    print(f"MGMTD FAILOVER: kill -9 of the primary to the routing map served again: {stall:.2f}s")

    # a storage failure afterwards: the new primary takes it out of its chains
    version = after["version"]
    ha.kill("storage1")
    reacted = ha.wait_for(
        "storage1's target offline",
        lambda: any(t["state"] == "offline" for t in ha.routing()["targets"]),
    )
    routing = ha.routing()
    assert routing["version"] > version
    print(f"after the failover, a dead storage node was taken out in {reacted:.1f}s")

    # one etcd member dies: still serving, and still taking changes
    ha.etcd.kill(0)
    ha.start("storage1")
    ha.wait_for("storage1 back and serving", lambda: storage_serving(ha, 3), timeout=90)

    # `shufflefs status --json` gives every mgmtd instance's role
    out = shufflefs("status", "--json", "--config", str(ha.client_config)).stdout
    status = json.loads(out)
    roles_seen = {r["address"]: r["role"] for r in status["mgmtd"]}
    assert roles_seen[first] == "unreachable"
    assert sorted(roles_seen.values()) == ["primary", "standby", "unreachable"]
    [node] = [n for n in status["nodes"] if n["kind"] == "mgmtd"]
    assert node["role"] == "primary" and roles_seen[node["address"]] == "primary"
