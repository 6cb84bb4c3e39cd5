"""The cluster and tools the operator-command tests share (metrics, status
page, df/info/warmup/top): one mounted three-node cluster with fast
heartbeats for the session (registered in conftest.py), headless Chromium,
and parsed metrics endpoints."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from clusters import HEARTBEAT_FAST, ProcessCluster, require_fuse
from harness import shufflefs
from prometheus_client.parser import text_string_to_metric_families

from shufflefs.cluster.launcher import free_ports
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


class MeteredMount:
    """A mount of a test cluster with a metrics endpoint of its own, and the
    counter family a test follows, by one label."""

    def __init__(self, mountpoint: Path, metrics: str, family: str, label: str) -> None:
        self.mountpoint = mountpoint
        self.metrics = f"http://{metrics}/metrics"
        self.family = family
        self.label = label

    def count(self, value: str) -> float:
        return total(self.metrics, self.family, **{self.label: value})


def metered_mount(
    cluster: ProcessCluster, where: Path, options: str, family: str, label: str
) -> Iterator[MeteredMount]:
    """Mount *cluster* at *where* with *options* (a generator: ``for m in``
    or ``yield from``); unmounted after."""
    metrics = f"127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    given = f"{options},metrics={metrics}" if options else f"metrics={metrics}"
    shufflefs("mount", "--config", str(cluster.client_config), "-o", given, str(where))
    try:
        yield MeteredMount(where, metrics, family, label)
    finally:
        shufflefs("umount", str(where))


@contextmanager
def metered_mounts(
    cluster: ProcessCluster,
    factory: pytest.TempPathFactory,
    prefix: str,
    options: dict[str, str],
    family: str,
    label: str,
) -> Iterator[dict[str, MeteredMount]]:
    """A `metered_mount` of *cluster* per name in *options* (its mount
    options), each in a directory of its own; all unmounted after."""
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(
                contextmanager(metered_mount)(
                    cluster, factory.mktemp(f"{prefix}-{name}"), opts, family, label
                )
            )
            for name, opts in options.items()
        }


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
