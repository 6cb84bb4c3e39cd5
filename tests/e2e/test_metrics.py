"""Prometheus endpoints of a real cluster: every service and the mount serve
them, `status --json` names them, and the counters move with real reads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusters import HEARTBEAT_FAST, ProcessCluster, wait_until
from prometheus_client.parser import text_string_to_metric_families

from shufflefs.client import Client
from shufflefs.client.fs import ClientOptions
from shufflefs.cluster.metrics_scrape import fetch

FILE_SIZE = 3 << 20


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    base = tmp_path_factory.mktemp("metrics")
    c = ProcessCluster(base / "data", base / "mnt", mgmtd_settings=HEARTBEAT_FAST)
    c.up()
    try:
        c.all_serving()
        yield c
    finally:
        c.down()


def samples(url: str) -> dict[str, list[Any]]:
    """Every sample at *url*, by family name (parsed as Prometheus parses it)."""
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(fetch(url)):
        out.setdefault(family.name, []).extend(family.samples)
    return out


def total(url: str, family: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples(url).get(family, [])
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


def mount_url(status: dict[str, Any]) -> str:
    mounts = [c for c in status["clients"] if c["kind"] == "mount"]
    assert len(mounts) == 1, status["clients"]
    return str(mounts[0]["metrics"])


def test_status_names_every_endpoint_and_each_parses(ops: ProcessCluster) -> None:
    status = ops.status()
    assert status["web"] and status["web"].endswith("/")
    page = fetch(status["web"])
    assert "<title>shufflefs status</title>" in page
    urls = [n["metrics"] for n in status["nodes"]]
    assert all(u and u.startswith("http://") for u in urls), status["nodes"]
    kinds = {n["kind"] for n in status["nodes"]}
    assert kinds == {"mgmtd", "meta", "storage"}
    for url in [*urls, mount_url(status)]:
        families = samples(url)
        assert "process_cpu_seconds" in families, url  # the process collector rides along
    mgmtd_url = next(n["metrics"] for n in status["nodes"] if n["kind"] == "mgmtd")
    mgmtd = samples(mgmtd_url)
    serving = {
        s.labels["target"]
        for s in mgmtd["shufflefs_target_state"]
        if s.labels["state"] == "serving" and s.value == 1
    }
    assert serving == {str(t["id"]) for t in status["targets"]}
    chains = {s.labels["chain"]: s.value for s in mgmtd["shufflefs_chain_serving_replicas"]}
    assert chains == {str(c["id"]): 3.0 for c in status["chains"]}
    capacity = next(s.value for s in mgmtd["shufflefs_cluster_capacity_bytes"])
    assert capacity == status["capacity"]["capacity"]
    storage_url = next(n["metrics"] for n in status["nodes"] if n["kind"] == "storage")
    assert "shufflefs_storage_target_free_bytes" in samples(storage_url)


def test_reads_move_the_counters(ops: ProcessCluster) -> None:
    status = ops.status()
    mount = mount_url(status)
    meta = next(n["metrics"] for n in status["nodes"] if n["kind"] == "meta")
    storage = [n["metrics"] for n in status["nodes"] if n["kind"] == "storage"]
    data = os.urandom(FILE_SIZE)
    commits0 = sum(
        s.value
        for s in samples(meta)["shufflefs_meta_commit_batch_size"]
        if s.name.endswith("_count")
    )
    path = Path(ops.mountpoint) / "counted"
    path.write_bytes(data)
    read0 = total(mount, "shufflefs_client_bytes", op="read")
    assert path.read_bytes() == data
    assert total(mount, "shufflefs_client_bytes", op="read") - read0 >= FILE_SIZE
    assert total(mount, "shufflefs_client_bytes", op="write") >= FILE_SIZE
    commits1 = sum(
        s.value
        for s in samples(meta)["shufflefs_meta_commit_batch_size"]
        if s.name.endswith("_count")
    )
    assert commits1 > commits0  # the create (at least) was a group commit

    # through the storage daemons (no local reads) by a native client with metrics on
    sent0 = sum(total(u, "shufflefs_rpc_sent_bytes", service="storage") for u in storage)
    calls0 = sum(total(u, "shufflefs_rpc_requests", service="storage") for u in storage)
    with Client(
        ops.client_config, ClientOptions(local_reads=False), metrics="127.0.0.1:0"
    ) as client:
        assert client.metrics_url is not None
        with client.open("/counted", "rb") as f:
            assert f.read() == data
        assert total(client.metrics_url, "shufflefs_client_bytes", op="read") >= FILE_SIZE
        wait_until(  # announced within a couple of seconds
            "the native client's endpoint in status",
            lambda: client.metrics_url in [c["metrics"] for c in ops.status()["clients"]],
            timeout=15,
        )
    sent1 = sum(total(u, "shufflefs_rpc_sent_bytes", service="storage") for u in storage)
    calls1 = sum(total(u, "shufflefs_rpc_requests", service="storage") for u in storage)
    assert sent1 - sent0 >= FILE_SIZE
    assert calls1 > calls0
    storage_samples = samples(storage[0])
    latency = [
        s
        for s in storage_samples["shufflefs_rpc_latency_seconds"]
        if s.name.endswith("_count") and s.value > 0
    ]
    assert latency, "no latency histogram observed"
