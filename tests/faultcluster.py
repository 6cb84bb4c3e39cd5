"""A replicated cluster whose storage daemons each run on their own test host
(the `fault_cluster` fixture of tests/faults).

Three storage nodes, each in its own network namespace (`tests/hosts.py`),
chains of three replicas, mgmtd and the metadata server on the bridge
address in the root namespace, a FUSE mount. Heartbeats are fast (a node is
declared dead after 3 s) so failure tests finish quickly. Where network
namespaces cannot be made, every node runs on loopback instead and the test
output says so (then "cutting a host's network" is not possible and those
tests fail with that reason).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import shufflefs
from hosts import TestHosts, namespaces_available

from shufflefs.cluster import procs
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.launcher import LocalCluster, up
from shufflefs.cluster.protocol import MgmtdStub, RoutingInfo
from shufflefs.rpc.client import open_rpc_client

HEARTBEAT = {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0}


@dataclass
class FaultCluster:
    local: LocalCluster
    mountpoint: Path
    hosts: TestHosts | None

    @property
    def config(self) -> Path:
        return self.local.client_config

    def service(self, name: str) -> procs.ServiceProcess:
        return next(s for s in self.local.services() if s.name == name)

    def kill(self, name: str) -> None:
        pid = procs.running_pid(self.service(name))
        assert pid is not None, f"{name} is not running"
        procs.signal_pid(pid, 9)
        assert procs.wait_exit(pid, 10)

    def restart_missing(self) -> None:
        """What an operator does: `shufflefs up` starts whatever is not running."""
        up(self.local.dir, None, out=io.StringIO())

    def status(self) -> dict[str, Any]:
        out = shufflefs("status", "--json", "--config", str(self.config)).stdout
        result: dict[str, Any] = json.loads(out)
        return result

    def routing(self) -> RoutingInfo:
        _, secret = load_client_config(self.config)
        layout = self.local.layout()

        async def fetch() -> RoutingInfo:
            async with open_rpc_client(secret) as rpc:
                return await MgmtdStub(rpc, f"{layout.host}:{layout.mgmtd_port}").status()

        return trio.run(fetch)

    def storage_node_of(self, name: str) -> int:
        """mgmtd's node id of storage daemon *name* (by its pid)."""
        pid = procs.running_pid(self.service(name))
        for n in self.status()["nodes"]:
            if n["pid"] == pid:
                return int(n["id"])
        raise AssertionError(f"{name} (pid {pid}) not registered")

    def wait_for(self, what: str, predicate: Any, timeout: float = 60.0) -> float:
        """Poll the status until *predicate(status)*; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            status = self.status()
            if predicate(status):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}: {json.dumps(status)[:2000]}")
            time.sleep(0.2)

    def all_serving(self) -> float:
        return self.wait_for(
            "every target serving",
            lambda s: all(t["state"] == "serving" for t in s["targets"]),
        )


@pytest.fixture
def fault_cluster(tmp_path: Path) -> Iterator[FaultCluster]:
    why_not = namespaces_available()
    hosts: TestHosts | None = None
    if why_not is None:
        hosts = TestHosts(3)
        hosts.create()
    else:
        print(f"NOTE: network namespaces unavailable ({why_not}); storage nodes on loopback")
    local = LocalCluster(tmp_path / "data")
    try:
        local.format(
            3,
            3,
            1 << 20,
            hosts.gateway if hosts else "127.0.0.1",
            storage_hosts=[hosts.address(i) for i in (1, 2, 3)] if hosts else None,
            storage_netns=[hosts.netns(i) for i in (1, 2, 3)] if hosts else None,
            mgmtd_settings=HEARTBEAT,
        )
        mnt = tmp_path / "mnt"
        up(local.dir, mnt, out=io.StringIO())
        cluster = FaultCluster(local, mnt, hosts)
        cluster.all_serving()
        yield cluster
    finally:
        shufflefs("down", "--data-dir", str(local.dir), check=False)
        if hosts is not None:
            hosts.destroy()
