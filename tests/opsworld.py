"""The cluster and tools the operator-command tests share (metrics, status
page, df/info/warmup/top): one mounted three-node cluster with fast
heartbeats for the session (registered in conftest.py), headless Chromium,
and parsed metrics endpoints."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusters import HEARTBEAT_FAST, ProcessCluster, require_fuse
from prometheus_client.parser import text_string_to_metric_families

from shufflefs.cluster.metrics_scrape import fetch

CHROMIUM_TIMEOUT = 60.0


@pytest.fixture(scope="session")
def ops_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    """Three storage nodes, replicas 3, mounted, every service's metrics on.
    A test that stops a service starts it again before it ends."""
    require_fuse()
    base = tmp_path_factory.mktemp("ops")
    c = ProcessCluster(base / "data", base / "mnt", mgmtd_settings=HEARTBEAT_FAST)
    with c.running():
        yield c


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


def chromium(url: str, *args: str, budget_ms: int = 3000) -> str:
    """Run headless Chromium on *url* (as root: without its sandbox), letting
    the page's scripts run for *budget_ms* of virtual time; returns stdout."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed (Debian package `chromium`; `make sysdeps`)")
    with tempfile.TemporaryDirectory(prefix="ops-chromium-") as profile:
        proc = subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-proxy-server",  # the page is on our own host
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget_ms}",
                *args,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=CHROMIUM_TIMEOUT,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def screenshot(url: str, out: Path, size: str = "1280,1000") -> None:
    chromium(url, f"--screenshot={out}", f"--window-size={size}", "--hide-scrollbars")
    assert out.exists() and out.stat().st_size > 0
