"""Prometheus endpoints and the status page of a real cluster: every service
and the mount serve metrics, `status --json` names them, the counters move
with real reads, and the page in headless Chromium follows a node's death."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from clusters import ProcessCluster, wait_until
from opsworld import chromium, samples, screenshot, total

from shufflefs.client import Client
from shufflefs.client.fs import ClientOptions
from shufflefs.cluster.metrics_scrape import fetch

FILE_SIZE = 3 << 20


def mount_url(status: dict[str, Any]) -> str:
    mounts = [c for c in status["clients"] if c["kind"] == "mount"]
    assert len(mounts) == 1, status["clients"]
    return str(mounts[0]["metrics"])


def test_status_names_every_endpoint_and_each_parses(ops_cluster: ProcessCluster) -> None:
    ops = ops_cluster
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


def test_reads_move_the_counters(ops_cluster: ProcessCluster) -> None:
    ops = ops_cluster
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


def page_states(web: str) -> dict[str, str]:
    """node id -> the state the page shows, from Chromium's rendered DOM."""
    dom = chromium(web, "--dump-dom")
    return dict(re.findall(r'<tr data-node="(\d+)" data-state="(\w+)"', dom))


def test_status_page_shows_a_storage_node_going_offline(
    ops_cluster: ProcessCluster, tmp_path: Path
) -> None:
    ops = ops_cluster
    status = ops.status()
    web = status["web"]
    assert page_states(web) == {str(n["id"]): "online" for n in status["nodes"]}
    shot = tmp_path / "page.png"
    screenshot(web, shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    victim = str(ops.storage_node_of("storage3"))
    ops.kill("storage3")
    try:
        deadline = time.monotonic() + 30.0
        shown = page_states(web)
        while shown.get(victim) != "offline" and time.monotonic() < deadline:
            time.sleep(0.5)
            shown = page_states(web)
        assert shown.get(victim) == "offline", shown
        assert all(state == "online" for node, state in shown.items() if node != victim)
    finally:
        ops.start("storage3")
        ops.all_serving()
    assert page_states(web)[victim] == "online"
