"""mgmtd as a real process: registration, routing, persistence across kill -9."""

from __future__ import annotations

import errno

import pytest
import trio
from clusters import ProcessCluster

from shufflefs.cluster.protocol import MgmtdStub, RoutingInfo, TargetRegistration
from shufflefs.rpc.errors import FsError


async def first_status(mgmtd: MgmtdStub) -> RoutingInfo:
    """The status, once the (re)started mgmtd answers (within 20 s)."""
    with trio.fail_after(20):
        while True:
            try:
                return await mgmtd.status()
            except FsError:
                await trio.sleep(0.05)


def test_mgmtd_persists_cluster_across_kill(process_cluster: ProcessCluster) -> None:
    cluster = process_cluster
    cluster.start("mgmtd", wait=False)

    async def register() -> tuple[str, int, list[int], int]:
        async with cluster.rpc() as rpc:
            mgmtd = MgmtdStub(rpc, cluster.mgmtd_address)
            await first_status(mgmtd)
            reg = await mgmtd.register_node(
                None,
                "storage",
                "127.0.0.1:1",
                "hostA",
                4242,
                None,
                [
                    TargetRegistration(
                        target_id=None, path="/x/t1", capacity=1000, free=900, device=1
                    )
                ],
            )
            routing = await mgmtd.get_routing(-1)
            assert routing is not None
            assert await mgmtd.get_routing(routing["version"]) is None
            kinds = sorted(n["kind"] for n in routing["nodes"])
            assert kinds == ["mgmtd", "storage"]
            assert routing["chains"] == [{"id": 1, "version": 1, "targets": reg["target_ids"]}]
            return reg["cluster_id"], reg["node_id"], reg["target_ids"], routing["version"]

    cluster_id, node_id, target_ids, version = trio.run(register)
    cluster.kill("mgmtd")
    cluster.start("mgmtd", wait=False)

    async def check() -> None:
        async with cluster.rpc() as rpc:
            mgmtd = MgmtdStub(rpc, cluster.mgmtd_address)
            status = await first_status(mgmtd)
            assert status["cluster_id"] == cluster_id
            assert status["version"] > version
            storage = [n for n in status["nodes"] if n["kind"] == "storage"]
            assert [n["id"] for n in storage] == [node_id]
            assert [t["id"] for t in status["targets"]] == target_ids
            with pytest.raises(FsError) as info:
                await mgmtd.register_node(
                    "not-this-cluster", "storage", "127.0.0.1:2", "h", 1, None, []
                )
            assert info.value.errno == errno.EINVAL
            with pytest.raises(FsError) as info:
                await mgmtd.heartbeat(999, 1, [])
            assert info.value.errno == errno.ENOENT

    trio.run(check)
