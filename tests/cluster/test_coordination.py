"""The coordination interface's embedded backend (leases, their epochs, a
restart) and how every client finds the primary among several mgmtd
addresses (a standby answers NOT_PRIMARY; a dead one is skipped). The etcd
backend runs the same lease calls in tests/faults/test_mgmtd_ha.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio

from shufflefs.cluster.coordination import EmbeddedCoordination
from shufflefs.cluster.meta_leases import LEASE_NAME, LEASE_TTL, MetaLeases
from shufflefs.cluster.mgmtd import MgmtdService
from shufflefs.cluster.protocol import NOT_PRIMARY, ClusterConfig, MgmtdStub
from shufflefs.cluster.state import ClusterState
from shufflefs.rpc import FsError, RpcServer, open_rpc_client

SECRET = b"0123456789abcdef0123456789abcdef"


async def test_embedded_leases(tmp_path: Path) -> None:
    coord = EmbeddedCoordination(tmp_path / "db")
    try:
        a = await coord.grant_lease("meta", "m1", 0.3)
        assert a["epoch"] == 1
        assert (await coord.grant_lease("meta", "m1", 0.3))["epoch"] == 1  # its holder again
        with pytest.raises(FsError) as busy:
            await coord.grant_lease("meta", "m2", 0.3)
        assert busy.value.code == errno.EBUSY
        assert await coord.renew_lease("meta", "m1", 1) == a
        await trio.sleep(0.4)  # not renewed: it lapses
        assert await coord.get_lease("meta") is None
        with pytest.raises(FsError) as gone:
            await coord.renew_lease("meta", "m1", 1)
        assert gone.value.code == errno.ESTALE
        b = await coord.grant_lease("meta", "m2", 5.0)
        assert b["epoch"] == 2
        with pytest.raises(FsError):
            await coord.grant_lease("meta", "x", 0.0)  # bad ttl
    finally:
        coord.close()
    # a restarted mgmtd: m2's lease still counts as held, epochs go on rising
    again = EmbeddedCoordination(tmp_path / "db")
    try:
        held = await again.get_lease("meta")
        assert held is not None and held["holder"] == "m2" and held["epoch"] == 2
        with pytest.raises(FsError):
            await again.grant_lease("meta", "m1", 1.0)
        await again.release_lease("meta", "m2", 2)
        assert (await again.grant_lease("meta", "m1", 1.0))["epoch"] == 3
    finally:
        again.close()


async def test_a_silent_metadata_primary_loses_its_lease_before_the_backend_lets_it_lapse(
    tmp_path: Path,
) -> None:
    """The backend keeps the metadata primary's lease a failover longer than
    its TTL (so it outlasts an mgmtd failover), but mgmtd hands it on once
    the holder has not renewed for a TTL by mgmtd's own clock; a new mgmtd
    primary counts that from when it first saw the lease."""
    coord = EmbeddedCoordination(tmp_path / "db")
    coord.failover_seconds = 60.0  # as etcd's, but longer than the test
    members = {1, 2, 3}

    async def ask(leases: MetaLeases, node: int, now: float) -> int | None:
        reply, _ = await leases.request(coord, node, 5, 1, members, 3, now)
        return reply["holder"]

    try:
        leases = MetaLeases()
        await ask(leases, 2, 0.0)
        assert await ask(leases, 1, 0.0) == 1  # a majority reported, none ahead
        assert await ask(leases, 2, 2.5) == 1
        assert await ask(leases, 1, 2.9) == 1  # renewed
        assert await ask(leases, 2, 5.5) == 1  # silent 2.6 s: still its
        assert await ask(leases, 3, 5.5) == 1
        assert await ask(leases, 2, 6.0) == 2  # silent past the TTL: handed on
        assert leases.epoch == 2
        live = await coord.get_lease(LEASE_NAME)
        assert live is not None and live["ttl"] == LEASE_TTL + 60.0
        fresh = MetaLeases()  # a new mgmtd primary, node 2 silent from now on
        assert await ask(fresh, 1, 100.0) == 2
        assert await ask(fresh, 3, 102.0) == 2
        assert await ask(fresh, 1, 103.5) == 1  # a TTL after it first saw the lease
    finally:
        coord.close()


async def test_stub_finds_the_primary(tmp_path: Path, nursery: trio.Nursery) -> None:
    config = ClusterConfig(
        chunk_size=1 << 20,
        stripe=4,
        replicas=1,
        min_replicas=1,
        heartbeat_interval=1.0,
        heartbeat_timeout=10.0,
    )
    primary_coord = EmbeddedCoordination(tmp_path / "p")
    primary_coord.elected.set()
    standby_coord = EmbeddedCoordination(tmp_path / "s")  # never elected
    try:
        primary = MgmtdService(ClusterState.new(config), primary_coord)
        standby = MgmtdService(None, standby_coord)
        ports = [
            await nursery.start(RpcServer(SECRET, [svc], name="mgmtd").serve, "127.0.0.1", 0)
            for svc in (standby, primary)
        ]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        standby_coord.primary = addresses[1]
        async with open_rpc_client(SECRET) as rpc:
            with pytest.raises(FsError) as refused:
                await MgmtdStub(rpc, addresses[0]).get_routing()
            assert refused.value.code == NOT_PRIMARY and addresses[1] in refused.value.message
            assert (await MgmtdStub(rpc, addresses[0]).role())["role"] == "standby"
            # a dead address first, then the standby, then the primary
            dead = "127.0.0.1:1"
            stub = MgmtdStub(rpc, ",".join([dead, *addresses]), timeout=3.0)
            routing = await stub.get_routing()
            assert routing is not None and routing["cluster_id"] == primary.state().cluster_id
            assert stub.address == addresses[1]
    finally:
        primary_coord.close()
        standby_coord.close()
