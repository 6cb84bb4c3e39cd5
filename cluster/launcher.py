"""`shufflefs format | up | down`: a whole cluster as local processes.

A data dir holds everything of one local cluster::

    cluster.toml        what format decided (address, ports, storage nodes, replicas)
    secret              the cluster secret (mode 0600)
    client.toml         how clients find the cluster (mgmtd address, secret)
    mgmtd/ meta/        each service's config and database
    storageN/           a storage node: config, node state, one target directory
    logs/               one log per service (+ .out: stdout/stderr before logging starts)
    run/                pid files, the mountpoint of the running mount

`up` formats a new data dir, or brings an existing one back: it starts what
is not running, leaves running services alone, and mounts. Every service runs
the same code as on a real cluster (``shufflefs mgmtd|meta|storage --config``);
only the addresses are loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster import procs
from shufflefs.cluster.config import CONFIG_ENV, find_client_config, load_client_config
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.metadata.protocol import MetaStub
from shufflefs.rpc.auth import generate_secret
from shufflefs.rpc.client import RpcClient, open_rpc_client
from shufflefs.rpc.config import load_config, write_toml
from shufflefs.rpc.errors import FsError

START_TIMEOUT = 60.0
NETNS_STORAGE_PORT = 9400


@dataclass
class ClusterLayout:
    """cluster.toml: the shape of a local cluster, fixed at format."""

    host: str
    mgmtd_port: int
    meta_port: int
    storage_ports: list[int]
    replicas: int
    chunk_size: int
    # Storage nodes on their own (test) hosts: each one's address, and the
    # network namespace it runs in. Empty: every node on `host`.
    storage_hosts: list[str] = field(default_factory=list)
    storage_netns: list[str] = field(default_factory=list)

    def storage_address(self, i: int) -> str:
        """host:port of storage node i (0-based)."""
        host = self.storage_hosts[i] if self.storage_hosts else self.host
        return f"{host}:{self.storage_ports[i]}"


class LocalCluster:
    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir).absolute()
        self.layout_file = self.dir / "cluster.toml"
        self.secret_file = self.dir / "secret"
        self.client_config = self.dir / "client.toml"
        self.logs = self.dir / "logs"
        self.run = self.dir / "run"

    def exists(self) -> bool:
        return self.layout_file.exists()

    def layout(self) -> ClusterLayout:
        if not self.exists():
            raise FsError(errno.ENOENT, f"{self.dir} holds no shufflefs cluster (no cluster.toml)")
        return load_config(self.layout_file, ClusterLayout)

    # ---- format --------------------------------------------------------------

    def format(
        self,
        storage_nodes: int,
        replicas: int,
        chunk_size: int,
        host: str,
        *,
        storage_hosts: list[str] | None = None,
        storage_netns: list[str] | None = None,
        mgmtd_settings: dict[str, Any] | None = None,
    ) -> ClusterLayout:
        """Write a new cluster's configs. *storage_hosts*/*storage_netns* put
        each storage node on its own address inside its own network namespace
        (the multi-host test harness); *mgmtd_settings* overrides mgmtd.toml
        keys (heartbeat timeouts, min_replicas)."""
        if self.exists():
            raise FsError(errno.EEXIST, f"{self.dir} already holds a cluster")
        if storage_nodes < 1:
            raise FsError(errno.EINVAL, "--storage-nodes must be at least 1")
        if replicas < 1:
            raise FsError(errno.EINVAL, "--replicas must be at least 1")
        if replicas > storage_nodes:
            raise FsError(
                errno.EINVAL, f"--replicas {replicas} needs at least {replicas} storage nodes"
            )
        ports = free_ports(host, 2 + (0 if storage_hosts else storage_nodes))
        if storage_hosts:
            if len(storage_hosts) != storage_nodes or len(storage_netns or []) != storage_nodes:
                raise FsError(errno.EINVAL, "need one host address and namespace per storage node")
            storage_ports = [NETNS_STORAGE_PORT] * storage_nodes  # each host has its own ports
        else:
            storage_ports = ports[2:]
        layout = ClusterLayout(
            host,
            ports[0],
            ports[1],
            storage_ports,
            replicas,
            chunk_size,
            list(storage_hosts or []),
            list(storage_netns or []),
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        generate_secret(self.secret_file)
        mgmtd = f"{host}:{layout.mgmtd_port}"
        common = {"secret_file": str(self.secret_file), "log_level": "INFO"}
        write_toml(
            self.dir / "mgmtd" / "mgmtd.toml",
            {
                "listen": mgmtd,
                "data_dir": str(self.dir / "mgmtd" / "db"),
                "log_file": str(self.logs / "mgmtd.log"),
                "replicas": replicas,
                "chunk_size": chunk_size,
                **common,
                **(mgmtd_settings or {}),
            },
        )
        write_toml(
            self.dir / "meta" / "meta.toml",
            {
                "listen": f"{host}:{layout.meta_port}",
                "mgmtd": mgmtd,
                "data_dir": str(self.dir / "meta" / "db"),
                "log_file": str(self.logs / "meta.log"),
                **common,
            },
        )
        for i in range(1, storage_nodes + 1):
            node = self.dir / f"storage{i}"
            own_host = {"host": f"host{i}"} if storage_hosts else {}
            write_toml(
                node / "storage.toml",
                {
                    "listen": layout.storage_address(i - 1),
                    "mgmtd": mgmtd,
                    "data_dir": str(node / "node"),
                    "targets": [str(node / "target1")],
                    "log_file": str(self.logs / f"storage{i}.log"),
                    **own_host,
                    **common,
                },
            )
        write_toml(self.client_config, {"mgmtd": mgmtd, "secret_file": "secret"})
        write_toml(self.layout_file, layout.__dict__)
        return layout

    # ---- processes -------------------------------------------------------------

    def services(self) -> list[procs.ServiceProcess]:
        layout = self.layout()
        out = [self._service("mgmtd", "mgmtd", self.dir / "mgmtd" / "mgmtd.toml")]
        out.append(self._service("meta", "meta", self.dir / "meta" / "meta.toml"))
        for i in range(1, len(layout.storage_ports) + 1):
            netns = layout.storage_netns[i - 1] if layout.storage_netns else None
            config = self.dir / f"storage{i}" / "storage.toml"
            out.append(self._service(f"storage{i}", "storage", config, netns))
        return out

    def _service(
        self, name: str, kind: str, config: Path, netns: str | None = None
    ) -> procs.ServiceProcess:
        return procs.ServiceProcess(
            name=name,
            argv=(kind, "--config", str(config)),
            marker=str(config),
            pid_file=self.run / f"{name}.pid",
            out_file=self.logs / f"{name}.out",
            netns=netns,
        )

    def mount_process(self, mountpoint: Path) -> procs.ServiceProcess:
        return procs.ServiceProcess(
            name="mount",
            argv=(
                "mount",
                "--foreground",
                "--config",
                str(self.client_config),
                "--log-file",
                str(self.logs / "mount.log"),
                str(mountpoint),
            ),
            marker=str(mountpoint),
            pid_file=self.run / "mount.pid",
            out_file=self.logs / "mount.out",
        )

    def recorded_mountpoint(self) -> Path | None:
        try:
            return Path((self.run / "mountpoint").read_text().strip())
        except OSError:
            return None


def default_replicas(storage_nodes: int, replicas: int | None) -> int:
    """Three copies when there are three nodes to hold them, else one."""
    if replicas is not None:
        return replicas
    return 3 if storage_nodes >= 3 else 1


def free_ports(host: str, count: int) -> list[int]:
    """Ports free right now on *host* (held open together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        return int(t[: len(t) - len(unit)]) * units[unit]
    except ValueError:
        raise FsError(errno.EINVAL, f"bad size {text!r} (try 1M, 4M, 512K)") from None


# ---- mounts -----------------------------------------------------------------------


def mounted_fstype(mountpoint: Path) -> str | None:
    """The filesystem type mounted exactly at *mountpoint*, if any."""
    target = str(mountpoint.absolute())
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")
        if point == target:
            found = fields[sep + 1]
    return found


def unmount(mountpoint: Path, lazy: bool = False) -> None:
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        msg = result.stderr.strip() or f"fusermount3 exited with {result.returncode}"
        raise FsError(errno.EBUSY if "busy" in msg.lower() else errno.EIO, msg)


# ---- readiness -------------------------------------------------------------------


async def wait_services_ready(cluster: LocalCluster, pids: dict[str, int], timeout: float) -> None:
    """Wait until mgmtd answers, every meta/storage process we know the pid of
    is registered and online, and the metadata server has seen the routing
    map that includes them (new files are laid out on the chains it knows)."""
    _, secret = load_client_config(cluster.client_config)
    layout = cluster.layout()
    address = f"{layout.host}:{layout.mgmtd_port}"
    deadline = trio.current_time() + timeout
    async with open_rpc_client(secret, connect_timeout=1.0, call_timeout=2.0) as rpc:
        mgmtd = MgmtdStub(rpc, address)
        while True:
            dead = [name for name, pid in pids.items() if not procs.alive(pid)]
            if dead:
                raise FsError(errno.ECHILD, f"{dead[0]} exited during startup")
            try:
                waiting = await _not_ready(rpc, mgmtd, pids)
            except FsError:
                waiting = "mgmtd"
            if waiting is None:
                return
            if trio.current_time() > deadline:
                raise FsError(errno.ETIMEDOUT, f"{waiting} did not come up within {timeout:g}s")
            await trio.sleep(0.1)


async def _not_ready(rpc: RpcClient, mgmtd: MgmtdStub, pids: dict[str, int]) -> str | None:
    """What is still missing, or None."""
    status = await mgmtd.status()
    online = {n["pid"]: n for n in status["nodes"] if n["state"] == "online"}
    for name, pid in pids.items():
        if pid not in online:
            return name
    metas = [n for n in online.values() if n["kind"] == "meta"]
    if metas and await MetaStub(rpc, metas[0]["address"]).routing_version() < status["version"]:
        return "meta (routing map)"
    return None


def wait_mounted(mountpoint: Path, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mounted_fstype(mountpoint) == "fuse.shufflefs":
            return
        if not procs.alive(pid):
            raise FsError(errno.ECHILD, "the mount process exited")
        time.sleep(0.05)
    raise FsError(errno.ETIMEDOUT, f"{mountpoint} was not mounted within {timeout:g}s")


# ---- commands ----------------------------------------------------------------------


def up(
    data_dir: str | Path,
    mountpoint: str | Path | None,
    storage_nodes: int = 3,
    replicas: int | None = None,
    chunk_size: int = 1 << 20,
    host: str = "127.0.0.1",
    out: Any = sys.stdout,
) -> LocalCluster:
    cluster = LocalCluster(data_dir)
    if not cluster.exists():
        cluster.format(storage_nodes, default_replicas(storage_nodes, replicas), chunk_size, host)
        print(f"formatted a new cluster in {cluster.dir}", file=out)
    started: dict[str, int] = {}
    for service in cluster.services():
        pid = procs.running_pid(service)
        if pid is None:
            pid = procs.start(service)
            started[service.name] = pid
            print(f"started {service.name} (pid {pid})", file=out)
    try:
        pids = {
            s.name: p
            for s in cluster.services()
            if (p := procs.running_pid(s)) and s.name != "mgmtd"
        }
        trio.run(wait_services_ready, cluster, pids, START_TIMEOUT)
    except FsError as exc:
        raise FsError(
            exc.code,
            f"{exc.message}; see the logs in {cluster.logs}:\n" + last_logs(cluster, started),
        ) from None
    if mountpoint is not None:
        mount_local(cluster, Path(mountpoint).absolute(), out)
    return cluster


def last_logs(cluster: LocalCluster, names: dict[str, int]) -> str:
    parts = []
    for name in names or ["mgmtd"]:
        for suffix in (".out", ".log"):
            text = procs.tail(cluster.logs / f"{name}{suffix}", 8)
            if text:
                parts.append(f"--- {name}{suffix}\n{text}")
    return "\n".join(parts)


def mount_local(cluster: LocalCluster, mountpoint: Path, out: Any) -> None:
    proc = cluster.mount_process(mountpoint)
    pid = procs.running_pid(proc)
    fstype = mounted_fstype(mountpoint)
    if pid is not None and fstype == "fuse.shufflefs":
        print(f"{mountpoint} is already mounted", file=out)
        return
    if fstype == "fuse.shufflefs":  # a mount whose process died: clear it
        with contextlib.suppress(FsError):
            unmount(mountpoint, lazy=True)
    elif fstype is not None:
        raise FsError(errno.EBUSY, f"{mountpoint} already has a {fstype} filesystem mounted")
    if pid is not None:
        procs.stop(proc)
    mountpoint.mkdir(parents=True, exist_ok=True)
    pid = procs.start(proc)
    try:
        wait_mounted(mountpoint, pid, START_TIMEOUT)
    except FsError as exc:
        raise FsError(exc.code, f"{exc.message}:\n" + last_logs(cluster, {"mount": pid})) from None
    (cluster.run / "mountpoint").write_text(f"{mountpoint}\n")
    print(f"mounted at {mountpoint} (pid {pid})", file=out)


def down(data_dir: str | Path, out: Any = sys.stdout) -> None:
    cluster = LocalCluster(data_dir)
    cluster.layout()  # a clear error if this is not a cluster
    mountpoint = cluster.recorded_mountpoint()
    if mountpoint is not None:
        if mounted_fstype(mountpoint) == "fuse.shufflefs":
            try:
                unmount(mountpoint)
            except FsError as exc:
                print(f"warning: {exc.message}; detaching {mountpoint} lazily", file=out)
                unmount(mountpoint, lazy=True)
            print(f"unmounted {mountpoint}", file=out)
        if procs.stop(cluster.mount_process(mountpoint)):
            print("stopped mount", file=out)
        with contextlib.suppress(OSError):
            (cluster.run / "mountpoint").unlink()
    for service in reversed(cluster.services()):
        if procs.stop(service):
            print(f"stopped {service.name}", file=out)


def cli_format(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args.data_dir)
    layout = cluster.format(
        args.storage_nodes,
        default_replicas(args.storage_nodes, args.replicas),
        parse_size(args.chunk_size),
        args.host,
    )
    print(
        f"formatted a new cluster in {cluster.dir}: mgmtd at {layout.host}:{layout.mgmtd_port}, "
        f"{len(layout.storage_ports)} storage nodes; client config {cluster.client_config}"
    )
    return 0


def cli_up(args: argparse.Namespace) -> int:
    cluster = up(
        args.data_dir,
        None if args.no_mount else args.mountpoint,
        storage_nodes=args.storage_nodes,
        replicas=args.replicas,
        chunk_size=parse_size(args.chunk_size),
        host=args.host,
    )
    print(f"cluster up; client config: {cluster.client_config}")
    found = find_client_config().absolute()
    if CONFIG_ENV not in os.environ and found != cluster.client_config:
        print(f"  export SHUFFLEFS_CONFIG={cluster.client_config}")
    return 0


def cli_down(args: argparse.Namespace) -> int:
    down(args.data_dir)
    return 0
