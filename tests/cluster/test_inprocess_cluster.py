"""The in-process cluster fixture itself: what the unit layer builds on."""

from __future__ import annotations

from clusters import ChainCluster

from shufflefs.metadata.stub import MetaStub


async def test_metadata_server_joins_the_in_process_cluster(cluster: ChainCluster) -> None:
    address = await cluster.start_meta()
    routing = await cluster.sync_maps()
    assert routing.meta_address() == address
    kinds = sorted(n["kind"] for n in routing.nodes.values() if n["state"] == "online")
    assert kinds == ["meta", "mgmtd", "storage", "storage", "storage"]
    assert await MetaStub(cluster.rpc, address).routing_version() >= 1
