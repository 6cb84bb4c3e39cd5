"""Metrics pieces without a cluster: the RPC server's counting, mgmtd's
endpoint directory, the HTTP endpoint, reading totals back as rates."""

from __future__ import annotations

import errno
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client import REGISTRY

from shufflefs.cluster.config import MgmtdConfig
from shufflefs.cluster.metrics import start_metrics
from shufflefs.cluster.metrics_registry import EXPIRY, MAX_ENDPOINTS, MetricsDirectory
from shufflefs.cluster.metrics_scrape import Totals, fetch, parse_totals, rates
from shufflefs.rpc import FsError, Reply, RpcServer, open_rpc_client, rpc_method

SECRET = b"0123456789abcdef0123456789abcdef"


class Svc:
    @rpc_method
    async def upper(self, payload: bytearray | None) -> Reply:
        assert payload is not None
        return Reply(None, bytes(payload).upper())

    @rpc_method
    async def fail(self) -> None:
        raise FsError(errno.ENOSPC, "full")


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_server_counts_requests_errors_bytes_latency(nursery: trio.Nursery) -> None:
    server = RpcServer(SECRET, [Svc()], name="unit-metrics")
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    addr = f"127.0.0.1:{port}"
    labels = {"service": "unit-metrics", "method": "upper"}
    before = value("shufflefs_rpc_requests_total", **labels)
    async with open_rpc_client(SECRET) as rpc:
        for _ in range(3):
            await rpc.call(addr, "upper", payload=b"abcd")
        with pytest.raises(FsError):
            await rpc.call(addr, "fail")
    assert value("shufflefs_rpc_requests_total", **labels) - before == 3
    assert value("shufflefs_rpc_received_bytes_total", **labels) >= 12
    assert value("shufflefs_rpc_sent_bytes_total", **labels) >= 12
    assert value("shufflefs_rpc_latency_seconds_count", **labels) >= 3
    assert (
        value(
            "shufflefs_rpc_errors_total",
            service="unit-metrics",
            method="fail",
            errno=str(errno.ENOSPC),
        )
        == 1
    )


def test_directory_expires_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("shufflefs.cluster.metrics_registry.time.monotonic", lambda: now[0])
    d = MetricsDirectory()
    d.add("storage", 2, "", "http://h:1/metrics")
    d.add("mount", None, "h:42", "http://h:2/metrics")
    assert d.url_of(2) == "http://h:1/metrics"
    assert [e["kind"] for e in d.endpoints()] == ["storage", "mount"]
    now[0] += EXPIRY + 1
    assert d.endpoints() == [] and d.url_of(2) is None
    for i in range(MAX_ENDPOINTS + 10):
        d.add("mount", None, f"h:{i}", "http://x" * 1000)
    found = d.endpoints()
    assert len(found) == MAX_ENDPOINTS
    assert max(len(e["url"]) for e in found) <= 512


def test_totals_and_rates() -> None:
    text = "\n".join(
        [
            'shufflefs_rpc_requests_total{service="storage",method="read"} 10',
            'shufflefs_rpc_requests_total{service="storage",method="heartbeat"} 99',
            'shufflefs_rpc_sent_bytes_total{service="storage",method="read"} 4096',
            'shufflefs_client_bytes_total{op="write"} 100',
            'shufflefs_rpc_latency_seconds_sum{service="storage",method="read"} 0.02',
            'shufflefs_rpc_latency_seconds_count{service="storage",method="read"} 10',
            "",
        ]
    )
    t0 = Totals(at=0.0)
    t1 = parse_totals(text, at=2.0)
    assert (t1.ops, t1.read_bytes, t1.write_bytes) == (10, 4096, 100)  # heartbeats are not I/O
    r = rates(t0, t1)
    assert (r.iops, r.read_bps, r.write_bps) == (5, 2048, 50)
    assert r.latency_ms == pytest.approx(2.0)
    assert rates(t1, Totals(at=3.0)).iops == 0  # an endpoint that restarted counts from zero


async def test_endpoint_serves_metrics_and_404(nursery: trio.Nursery) -> None:
    url = await start_metrics(nursery, "127.0.0.1:0", kind="unit")
    assert url is not None
    body = await trio.to_thread.run_sync(fetch, url)
    assert "shufflefs_rpc_requests" in body
    with pytest.raises(urllib.error.HTTPError) as info:
        await trio.to_thread.run_sync(fetch, url.replace("/metrics", "/nope"))
    assert info.value.code == 404


async def test_endpoint_on_a_taken_port_is_one_error(nursery: trio.Nursery) -> None:
    url = await start_metrics(nursery, "127.0.0.1:0", kind="unit")
    assert url is not None
    taken = url.split("/")[2]
    with pytest.raises(FsError) as info:
        await start_metrics(nursery, taken, kind="unit")
    assert "metrics endpoint" in info.value.message


def test_bad_metrics_address_is_refused_by_the_config() -> None:
    config = MgmtdConfig("127.0.0.1:1", "/tmp/x", "/tmp/s", metrics="no-port")
    with pytest.raises(FsError) as info:
        config.validate("mgmtd.toml")
    assert "metrics" in info.value.message


DOCS = Path(__file__).parents[2] / "docs"


def documented() -> set[str]:
    table = (DOCS / "metrics.md").read_text()
    names = set()
    for row in table.splitlines():
        if row.startswith("| `shufflefs_"):
            first = row.split("|")[1]
            stem = ""
            for part in re.findall(r"`([a-z_]+)`", first):
                if part.startswith("shufflefs_"):
                    stem = part
                    names.add(part)
                else:  # `_free_bytes`: the previous name's stem with another ending
                    names.add(re.sub(r"_(capacity|free|used)_bytes$", "", stem) + part)
    return names


def test_every_instrument_is_documented_and_the_dashboard_uses_only_those() -> None:
    # both register their instruments on import
    import shufflefs.cluster.metrics_catalog
    import shufflefs.storage.cache_counts  # noqa: F401

    names = documented()
    registered = {m.name for m in REGISTRY.collect() if m.name.startswith("shufflefs_")}
    for name in registered:
        assert name in names or f"{name}_total" in names, f"{name} missing from docs/metrics.md"
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    used = set(re.findall(r"shufflefs_[a-z_]+", json.dumps(dashboard)))
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in names or name in names, f"dashboard uses undocumented {name}"


async def test_counted_calls_pass_keyword_arguments_through() -> None:
    """`instrument` wraps a client's read_into: the prefetcher's keyword
    (``cold=True``) reaches the read and the read is counted; and its
    write_now, counted when it wrote."""
    from shufflefs.cluster.metrics_client import instrument

    class Fs:
        async def write(self, fh: int, offset: int, data: bytes) -> int:
            return len(data)

        async def read_into(self, extents: list[Any], out: memoryview, cold: bool = False) -> str:
            return f"cold={cold}"

        def write_now(self, fh: int, offset: int, data: bytes) -> int | None:
            return len(data) if data else None

    def reads_counted() -> float:
        return REGISTRY.get_sample_value("shufflefs_client_ops_total", {"op": "read"}) or 0.0

    fs = Fs()
    instrument(fs)
    before = reads_counted()
    assert await fs.read_into([(1, None, 0, 4096)], memoryview(bytearray(4096)), cold=True) == (
        "cold=True"
    )
    assert reads_counted() == before + 1

    def writes_counted() -> float:
        return REGISTRY.get_sample_value("shufflefs_client_ops_total", {"op": "write"}) or 0.0

    # a mount's WRITE answered in libfuse's callback counts as a write; one it
    # declined (None: the usual way then counts it) does not
    before = writes_counted()
    assert fs.write_now(1, 0, b"abc") == 3 and fs.write_now(1, 0, b"") is None
    assert writes_counted() == before + 1
