"""Test harness: real service processes on loopback, stopped by pid.

Tests use the same launcher `shufflefs up` uses (cluster.launcher), so what
they exercise is what users run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from shufflefs.cluster import procs
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.launcher import LocalCluster, wait_services_ready
from shufflefs.rpc.client import RpcClient, open_rpc_client


class Cluster:
    """A formatted local cluster whose processes a test starts and kills."""

    def __init__(self, data_dir: Path, storage_nodes: int = 3, chunk_size: int = 1 << 20) -> None:
        self.local = LocalCluster(data_dir)
        if not self.local.exists():
            self.local.format(storage_nodes, 1, chunk_size, "127.0.0.1")
        self.layout = self.local.layout()
        self.mgmtd_address = f"127.0.0.1:{self.layout.mgmtd_port}"

    def service(self, name: str) -> procs.ServiceProcess:
        return next(s for s in self.local.services() if s.name == name)

    def names(self) -> list[str]:
        return [s.name for s in self.local.services()]

    def start(self, *names: str, wait: bool = True) -> dict[str, int]:
        pids = {}
        for name in names or self.names():
            svc = self.service(name)
            pid = procs.running_pid(svc) or procs.start(svc)
            pids[name] = pid
        if wait:
            trio.run(
                wait_services_ready,
                self.local,
                {n: p for n, p in pids.items() if n != "mgmtd"},
                60.0,
            )
        return pids

    def pid(self, name: str) -> int | None:
        return procs.running_pid(self.service(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pid(name)
        assert pid is not None, f"{name} is not running"
        procs.signal_pid(pid, sig)
        assert procs.wait_exit(pid, 15.0), f"{name} did not exit"

    def stop_all(self) -> None:
        for svc in reversed(self.local.services()):
            procs.stop(svc)

    def secret(self) -> bytes:
        return load_client_config(self.local.client_config)[1]

    @asynccontextmanager
    async def rpc(self) -> AsyncIterator[RpcClient]:
        async with open_rpc_client(self.secret()) as rpc:
            yield rpc

    def log(self, name: str) -> str:
        return (self.local.logs / f"{name}.log").read_text(errors="replace")


def shufflefs(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the real `shufflefs` command."""
    result = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"shufflefs {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result


def flip(path: str | Path, offset: int) -> None:
    """Corrupt one byte of a file in place (as a failing disk would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
