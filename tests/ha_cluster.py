"""The HA control plane as real processes, for tests: a 3-member etcd cluster
on loopback (`EtcdCluster`: Debian's ``etcd``, own data dirs and ports) and
several mgmtd instances keeping the cluster state in it, with storage
daemons that know every mgmtd address (`HaCluster`). Everything is started
by the test and stopped by pid.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import trio

from shufflefs.cluster import procs
from shufflefs.cluster.config import ClientConfig, MgmtdConfig
from shufflefs.cluster.etcd_procs import EtcdMembers, wait_healthy
from shufflefs.cluster.launcher import free_ports
from shufflefs.cluster.protocol import MgmtdRole, MgmtdStub, RoutingInfo
from shufflefs.rpc import FsError, open_rpc_client
from shufflefs.storage.config import StorageConfig

SECRET = b"0123456789abcdef0123456789abcdef"
HOST = "127.0.0.1"


class EtcdCluster:
    """A 3-member etcd cluster on loopback: the package's own etcd processes
    (`shufflefs.cluster.etcd_procs`, as `shufflefs up --ha` runs them)."""

    def __init__(self, base: Path, members: int = 3) -> None:
        if shutil.which("etcd") is None:
            pytest.fail("etcd is not installed (Debian package etcd-server, in SYSTEM_PACKAGES)")
        self.base = base
        ports = free_ports(HOST, 2 * members)
        self.members = EtcdMembers(HOST, ports[:members], ports[members:], base, base, base)
        self.services = self.members.services()

    @property
    def endpoints(self) -> list[str]:
        return self.members.endpoints

    def start_all(self) -> None:
        pids = {s.name: procs.start(s) for s in self.services}
        wait_healthy(self.members, pids, 30.0)

    def kill(self, i: int) -> None:
        pid = procs.running_pid(self.services[i])
        assert pid is not None, f"{self.services[i].name} is not running"
        procs.signal_pid(pid, signal.SIGKILL)
        assert procs.wait_exit(pid, 10.0)

    def stop_all(self) -> None:
        for service in self.services:
            procs.stop(service)


def _write(path: Path, config: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    path.write_text(tomli_w.dumps(values))
    return path


class HaCluster:
    """*mgmtds* mgmtd instances on etcd and *storage* storage daemons."""

    def __init__(
        self, base: Path, etcd: EtcdCluster, mgmtds: int = 3, storage: int = 3, **mgmtd: Any
    ) -> None:
        self.base = base
        self.etcd = etcd
        secret = base / "secret"
        base.mkdir(parents=True, exist_ok=True)
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        ports = free_ports(HOST, mgmtds)
        self.mgmtd_addresses = [f"{HOST}:{p}" for p in ports]
        listed = ",".join(self.mgmtd_addresses)
        self.services: dict[str, procs.ServiceProcess] = {}
        for i, address in enumerate(self.mgmtd_addresses):
            name = f"mgmtd{i + 1}"
            config = MgmtdConfig(
                listen=address,
                data_dir=str(base / name / "db"),
                secret_file=str(secret),
                log_file=str(base / "logs" / f"{name}.log"),
                replicas=3,
                etcd=etcd.endpoints,
                **mgmtd,
            )
            self._service(name, "mgmtd", _write(base / name / "mgmtd.toml", config))
        for i in range(storage):
            name = f"storage{i + 1}"
            config_s = StorageConfig(
                listen=f"{HOST}:0",
                mgmtd=listed,
                data_dir=str(base / name),
                secret_file=str(secret),
                targets=[str(base / name / "t0")],
                log_file=str(base / "logs" / f"{name}.log"),
                fsync=False,
                reserve_bytes=0,
                forward_timeout=3.0,
            )
            self._service(name, "storage", _write(base / name / "storage.toml", config_s))
        self.client_config = _write(
            base / "client.toml", ClientConfig(mgmtd=listed, secret_file=str(secret))
        )

    def _service(self, name: str, kind: str, config: Path) -> None:
        self.services[name] = procs.ServiceProcess(
            name=name,
            argv=(kind, "--config", str(config)),
            marker=str(config),
            pid_file=self.base / "run" / f"{name}.pid",
            out_file=self.base / "logs" / f"{name}.out",
        )

    def start(self, *names: str) -> None:
        for name in names or list(self.services):
            svc = self.services[name]
            if procs.running_pid(svc) is None:
                procs.start(svc)

    def kill(self, name: str) -> None:
        pid = procs.running_pid(self.services[name])
        assert pid is not None, f"{name} is not running"
        procs.signal_pid(pid, signal.SIGKILL)
        assert procs.wait_exit(pid, 15.0), f"{name} did not exit"

    def stop_all(self) -> None:
        for svc in reversed(list(self.services.values())):
            procs.stop(svc)

    def log(self, name: str) -> str:
        return (self.base / "logs" / f"{name}.log").read_text(errors="replace")

    # ---- asking it --------------------------------------------------------------------

    def roles(self) -> dict[str, MgmtdRole | None]:
        """Each mgmtd instance's answer to `role` (None: it does not answer)."""

        async def ask() -> dict[str, MgmtdRole | None]:
            out: dict[str, MgmtdRole | None] = {}
            async with open_rpc_client(SECRET) as rpc:
                for address in self.mgmtd_addresses:
                    try:
                        out[address] = await MgmtdStub(rpc, address, timeout=2.0).role()
                    except FsError:
                        out[address] = None
            return out

        return trio.run(ask)

    def primary(self) -> str | None:
        found = [a for a, r in self.roles().items() if r is not None and r["role"] == "primary"]
        assert len(found) <= 1, f"two primaries: {found}"
        return found[0] if found else None

    def routing(self) -> RoutingInfo:
        """The routing map, from whichever mgmtd is the primary."""

        async def fetch() -> RoutingInfo:
            async with open_rpc_client(SECRET) as rpc:
                return await MgmtdStub(rpc, ",".join(self.mgmtd_addresses), timeout=10.0).status()

        return trio.run(fetch)

    def wait_for(self, what: str, check: Any, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        while True:
            try:
                if check():
                    return time.monotonic() - t0
            except FsError:
                pass
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)
