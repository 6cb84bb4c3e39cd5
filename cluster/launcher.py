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
is not running, leaves running services alone, and mounts. Everything is
checked before anything is started or written (every service config through
its service's own validation); what `up` starts is supervised (`startup`).
Every service runs the same code as on a real cluster
(``shufflefs mgmtd|meta|storage --config``); only the addresses are loopback.
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
from shufflefs.cluster.cli_errors import UsageError
from shufflefs.cluster.config import CONFIG_ENV, ClientConfig, find_client_config
from shufflefs.cluster.etcd_procs import EtcdMembers, etcd_program, wait_healthy
from shufflefs.cluster.preflight import (
    check_dir_for_writing,
    check_mountpoint,
    check_service_paths,
    checked_dict,
    load_checked,
    load_client,
    mounted_fstype,
    parse_size,
    service_config_class,
)
from shufflefs.cluster.startup import (
    START_TIMEOUT,
    ServiceExited,
    StartTimeout,
    Startup,
    wait_services_ready,
)
from shufflefs.rpc.auth import generate_secret
from shufflefs.rpc.config import write_toml
from shufflefs.rpc.errors import FsError

NETNS_STORAGE_PORT = 9400
NETNS_META_PORT = 9401
DEFAULT_STORAGE_NODES = 3
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_HOST = "127.0.0.1"
HA_MGMTDS = 3  # `up --ha`: mgmtd instances, etcd members and (at least) metadata servers
# the settings `format`/`up` options become, to name the option in an error
FLAG_OF_SETTING = {"chunk_size": "--chunk-size", "replicas": "--replicas"}


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
    # metadata servers beyond the first (`--meta-servers N`): their ports
    meta_ports: list[int] = field(default_factory=list)
    # Metadata servers on their own (test) hosts, like storage_hosts: each
    # one's address and network namespace. Empty: every one on `host`.
    meta_hosts: list[str] = field(default_factory=list)
    meta_netns: list[str] = field(default_factory=list)

    @property
    def meta_servers(self) -> int:
        return 1 + len(self.meta_ports)

    def meta_address(self, i: int) -> str:
        """host:port of metadata server i (1-based)."""
        host = self.meta_hosts[i - 1] if self.meta_hosts else self.host
        return f"{host}:{[self.meta_port, *self.meta_ports][i - 1]}"

    targets_per_node: int = 1  # target directories per storage node (a disk each on a real node)
    # The HA control plane (`up --ha`): mgmtd instances beyond the first (their
    # ports), and the etcd members they keep the state in. Empty: one mgmtd
    # on its embedded store.
    mgmtd_ports: list[int] = field(default_factory=list)
    etcd_client_ports: list[int] = field(default_factory=list)
    etcd_peer_ports: list[int] = field(default_factory=list)

    @property
    def ha(self) -> bool:
        return bool(self.etcd_client_ports)

    @property
    def mgmtd_address(self) -> str:
        """Every mgmtd instance, as clients and services are told (``a,b,c``)."""
        return ",".join(f"{self.host}:{p}" for p in [self.mgmtd_port, *self.mgmtd_ports])

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
            raise UsageError(
                f"{self.dir} holds no shufflefs cluster (no cluster.toml)", errno.ENOENT
            )
        return load_checked(self.layout_file, ClusterLayout)

    def meta_dir(self, i: int) -> Path:
        """Metadata server i's folder (1-based: meta, meta2, meta3...)."""
        return self.dir / meta_name(i)

    def mgmtd_dir(self, i: int) -> Path:
        """mgmtd instance i's folder (1-based: mgmtd, mgmtd2, mgmtd3)."""
        return self.dir / mgmtd_name(i)

    def etcd(self, layout: ClusterLayout | None = None) -> EtcdMembers:
        """The etcd members of an HA cluster (data under etcd/)."""
        layout = layout or self.layout()
        return EtcdMembers(
            layout.host,
            layout.etcd_client_ports,
            layout.etcd_peer_ports,
            self.dir / "etcd",
            self.logs,
            self.run,
        )

    def storage_dir(self, i: int) -> Path:
        """Storage node i's folder (1-based, as in its name storageN)."""
        return self.dir / f"storage{i}"

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
        meta_servers: int = 1,
        meta_hosts: list[str] | None = None,
        meta_netns: list[str] | None = None,
        targets_per_node: int = 1,
        ha: bool = False,
    ) -> ClusterLayout:
        """Write a new cluster's configs. *storage_hosts*/*storage_netns* put
        each storage node on its own address inside its own network namespace
        (the multi-host test harness); *mgmtd_settings* overrides mgmtd.toml
        keys (heartbeat timeouts, min_replicas). *ha*: `HA_MGMTDS` mgmtd
        instances on a local etcd cluster of as many members."""
        if self.exists():
            raise UsageError(f"{self.dir} already holds a cluster", errno.EEXIST)
        check_dir_for_writing(self.dir, "--data-dir")
        if storage_nodes < 1:
            raise UsageError("--storage-nodes must be at least 1")
        if replicas < 1:
            raise UsageError("--replicas must be at least 1")
        if targets_per_node < 1:
            raise UsageError("--targets-per-node must be at least 1")
        if replicas > storage_nodes:
            raise UsageError(f"--replicas {replicas} needs at least {replicas} storage nodes")
        if meta_servers < 1:
            raise UsageError("--meta-servers must be at least 1")
        if ha and meta_servers < HA_MGMTDS:
            raise UsageError(
                f"--ha needs at least {HA_MGMTDS} metadata servers (--meta-servers {meta_servers} "
                "would leave a single point of failure)"
            )
        if ha:
            etcd_program()  # a clear error now if etcd is not installed
        extra_metas = 0 if meta_hosts else meta_servers - 1
        rpc_ports = 2 + (0 if storage_hosts else storage_nodes) + extra_metas
        # then the metrics ports: mgmtd's, each metadata server's, each storage node's
        # HA: the other mgmtds' rpc and metrics ports, each etcd member's two
        ha_ports = 2 * (HA_MGMTDS - 1) + 2 * HA_MGMTDS if ha else 0
        ports = free_ports(host, rpc_ports + 1 + meta_servers + storage_nodes + ha_ports)
        ports, ha_taken = ports[: len(ports) - ha_ports], ports[len(ports) - ha_ports :]
        metrics = iter(ports[rpc_ports:])
        ports = ports[:rpc_ports]
        meta_ports, ports = ports[len(ports) - extra_metas :], ports[: len(ports) - extra_metas]
        if meta_hosts:
            if len(meta_hosts) != meta_servers or len(meta_netns or []) != meta_servers:
                raise UsageError("need one host address and namespace per metadata server")
            ports[1], meta_ports = NETNS_META_PORT, [NETNS_META_PORT] * (meta_servers - 1)
        if storage_hosts:
            if len(storage_hosts) != storage_nodes or len(storage_netns or []) != storage_nodes:
                raise UsageError("need one host address and namespace per storage node")
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
            meta_ports,
            list(meta_hosts or []),
            list(meta_netns or []),
            targets_per_node,
        )
        mgmtd_metrics = [next(metrics)]
        if ha:
            others = HA_MGMTDS - 1
            layout.mgmtd_ports = ha_taken[:others]
            mgmtd_metrics += ha_taken[others : 2 * others]
            etcd_ports = ha_taken[2 * others :]
            layout.etcd_client_ports = etcd_ports[:HA_MGMTDS]
            layout.etcd_peer_ports = etcd_ports[HA_MGMTDS:]
        mgmtd = layout.mgmtd_address
        common = {"secret_file": str(self.secret_file), "log_level": "INFO"}
        configs: dict[Path, tuple[dict[str, Any], type[Any]]] = {}
        etcd = {"etcd": self.etcd(layout).endpoints} if ha else {}
        for i, port in enumerate([layout.mgmtd_port, *layout.mgmtd_ports], start=1):
            configs[self.mgmtd_dir(i) / "mgmtd.toml"] = (
                {
                    "listen": f"{host}:{port}",
                    "data_dir": str(self.mgmtd_dir(i) / "db"),
                    "log_file": str(self.logs / f"{mgmtd_name(i)}.log"),
                    "replicas": replicas,
                    "chunk_size": chunk_size,
                    "metrics": f"{host}:{mgmtd_metrics[i - 1]}",
                    "initial_nodes": storage_nodes,
                    **etcd,
                    **common,
                    **(mgmtd_settings or {}),
                },
                service_config_class("mgmtd"),
            )
        for i in range(1, layout.meta_servers + 1):
            settings: dict[str, Any] = (
                {"group_size": layout.meta_servers} if layout.meta_servers > 1 else {}
            )
            meta_metrics = f"{host}:{next(metrics)}"
            if layout.meta_hosts:
                settings["host"] = f"meta-host{i}"
                meta_metrics = f"{layout.meta_hosts[i - 1]}:{NETNS_META_PORT + 1}"
            configs[self.meta_dir(i) / "meta.toml"] = (
                {
                    "listen": layout.meta_address(i),
                    "mgmtd": mgmtd,
                    "data_dir": str(self.meta_dir(i) / "db"),
                    "log_file": str(self.logs / f"{meta_name(i)}.log"),
                    **settings,
                    "metrics": meta_metrics,
                    **common,
                },
                service_config_class("meta"),
            )
        for i in range(1, storage_nodes + 1):
            configs[self.storage_dir(i) / "storage.toml"] = self._storage_settings(
                layout, i, next(metrics)
            )
        client = {"mgmtd": mgmtd, "secret_file": "secret", "mount_metrics": f"{host}:0"}
        configs[self.client_config] = (client, ClientConfig)
        configs[self.layout_file] = (layout.__dict__, ClusterLayout)
        self.check_new_configs(configs)
        self.dir.mkdir(parents=True, exist_ok=True)
        generate_secret(self.secret_file)
        for path, (data, _) in configs.items():
            write_toml(path, data)
        return layout

    def _storage_settings(
        self, layout: ClusterLayout, i: int, metrics_port: int
    ) -> tuple[dict[str, Any], type[Any]]:
        """storage{i}/storage.toml of *layout*, its metrics at *metrics_port*
        (on its own test host: the port after its rpc port)."""
        node = self.storage_dir(i)
        own_host = {"host": f"host{i}"} if layout.storage_hosts else {}
        if layout.storage_hosts:
            metrics = f"{layout.storage_hosts[i - 1]}:{NETNS_STORAGE_PORT + 1}"
        else:
            metrics = f"{layout.host}:{metrics_port}"
        data = {
            "listen": layout.storage_address(i - 1),
            "mgmtd": layout.mgmtd_address,
            "data_dir": str(node / "node"),
            "targets": [str(node / f"target{k}") for k in range(1, layout.targets_per_node + 1)],
            "log_file": str(self.logs / f"storage{i}.log"),
            "secret_file": str(self.secret_file),
            "log_level": "INFO",
            "metrics": metrics,
            **own_host,
        }
        return data, service_config_class("storage")

    def add_storage_nodes(self, count: int) -> list[str]:
        """Grow the cluster to *count* storage nodes (configs only: `up`
        starts them, and mgmtd takes their targets in as spares)."""
        layout = self.layout()
        have = len(layout.storage_ports)
        if layout.storage_hosts:
            raise UsageError(
                f"{self.dir}: its storage nodes run on their own test hosts; "
                "up cannot add nodes to it"
            )
        ports = free_ports(layout.host, 2 * (count - have))  # rpc, then metrics
        layout.storage_ports = [*layout.storage_ports, *ports[: count - have]]
        metrics = ports[count - have :]
        configs = {
            self.storage_dir(i) / "storage.toml": self._storage_settings(
                layout, i, metrics[i - have - 1]
            )
            for i in range(have + 1, count + 1)
        }
        configs[self.layout_file] = (layout.__dict__, ClusterLayout)
        self.check_new_configs(configs)
        for path, (data, _) in configs.items():
            write_toml(path, data)
        return [f"storage{i}" for i in range(have + 1, count + 1)]

    def check_new_configs(self, configs: dict[Path, tuple[dict[str, Any], type[Any]]]) -> None:
        """The configs about to be written, through their services' own
        checks: a value a service would refuse is refused now, with the
        command-line option it came from, and nothing is written."""
        for path, (data, cls) in configs.items():
            try:
                checked_dict(data, cls, str(path.relative_to(self.dir)))
            except UsageError as exc:
                flags = [f"{f} {data[k]}" for k, f in FLAG_OF_SETTING.items() if k in exc.message]
                origin = f" (from {', '.join(flags)})" if flags else ""
                raise UsageError(
                    f"{exc.message}{origin}; nothing was written to {self.dir}", exc.code
                ) from None

    def check_configs(self) -> None:
        """Every config `up` would start a service with, as that service
        would accept it, and the directories it would create."""
        load_client(self.client_config)
        if self.layout().ha:
            etcd_program()  # installed still (a one-line error, not a failed start)
        for service in self.services():
            if service.program:  # etcd: checked by running it
                continue
            config_path = service.argv[2]
            config = load_checked(config_path, service_config_class(service.argv[0]))
            check_service_paths(config, config_path)

    # ---- processes -------------------------------------------------------------

    def services(self) -> list[procs.ServiceProcess]:
        layout = self.layout()
        out = self.etcd(layout).services() if layout.ha else []
        for i in range(1, 2 + len(layout.mgmtd_ports)):
            out.append(self._service(mgmtd_name(i), "mgmtd", self.mgmtd_dir(i) / "mgmtd.toml"))
        for i in range(1, layout.meta_servers + 1):
            netns = layout.meta_netns[i - 1] if layout.meta_netns else None
            config = self.meta_dir(i) / "meta.toml"
            out.append(self._service(meta_name(i), "meta", config, netns))
        for i in range(1, len(layout.storage_ports) + 1):
            netns = layout.storage_netns[i - 1] if layout.storage_netns else None
            config = self.storage_dir(i) / "storage.toml"
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


def mgmtd_name(i: int) -> str:
    """The name of mgmtd instance i (1-based): mgmtd, mgmtd2, mgmtd3."""
    return "mgmtd" if i == 1 else f"mgmtd{i}"


def meta_name(i: int) -> str:
    """The name of metadata server i (1-based): meta, meta2, meta3..."""
    return "meta" if i == 1 else f"meta{i}"


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
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    except OSError as exc:  # gaierror too: not a name or address of this machine
        reason = exc.strerror or str(exc)
        raise UsageError(f"--host {host}: cannot listen there ({reason})") from None
    finally:
        for s in socks:
            s.close()


# ---- mounts -----------------------------------------------------------------------


def unmount(mountpoint: Path, lazy: bool = False) -> None:
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        msg = result.stderr.strip() or f"fusermount3 exited with {result.returncode}"
        raise FsError(errno.EBUSY if "busy" in msg.lower() else errno.EIO, msg)


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
    storage_nodes: int | None = None,
    replicas: int | None = None,
    chunk_size: int | None = None,
    host: str | None = None,
    out: Any = sys.stdout,
    timeout: float = START_TIMEOUT,
    meta_servers: int | None = None,
    targets_per_node: int | None = None,
    ha: bool = False,
) -> LocalCluster:
    """Format (first time) or check (afterwards) the cluster in *data_dir*,
    start what is not running, wait until it is ready, and mount. Shape
    options left None mean "as it is"; on an existing cluster more storage
    nodes are added, any other difference is refused before anything starts.
    If a service does not come up, what this call started is stopped again.
    *ha* formats a new cluster with no single point of failure (`HA_MGMTDS`
    mgmtd instances on as many local etcd members, that many metadata
    servers); an existing cluster keeps the control plane it was formatted with."""
    cluster = LocalCluster(data_dir)
    mount_at = check_mountpoint(mountpoint) if mountpoint is not None else None
    if cluster.exists():
        if ha and not cluster.layout().ha:
            raise UsageError(
                f"{cluster.dir} was formatted without --ha (one mgmtd); the control plane is "
                "fixed at format (use a new --data-dir for an HA cluster)"
            )
        added = reconcile_shape(
            cluster, storage_nodes, replicas, chunk_size, host, meta_servers, targets_per_node
        )
        if added:
            names = ", ".join(added)
            print(f"added {names}; mgmtd places their targets (see `shufflefs status`)", file=out)
    else:
        nodes = storage_nodes or DEFAULT_STORAGE_NODES
        cluster.format(
            nodes,
            default_replicas(nodes, replicas),
            chunk_size or DEFAULT_CHUNK_SIZE,
            host or DEFAULT_HOST,
            meta_servers=meta_servers or (HA_MGMTDS if ha else 1),
            targets_per_node=targets_per_node or 1,
            ha=ha,
        )
        print(f"formatted a new cluster in {cluster.dir}", file=out)
        if ha:
            print(f"highly available: {HA_MGMTDS} etcd members, {HA_MGMTDS} mgmtd", file=out)
        elif not meta_servers or meta_servers == 1:
            print("one metadata server: for failover, format with --meta-servers 3", file=out)
    cluster.check_configs()
    startup = Startup(cluster, out)
    try:
        services = cluster.services()
        etcds = [s for s in services if s.program]
        if etcds:  # mgmtd keeps its state in them
            wait_healthy(cluster.etcd(), {s.name: startup.ensure(s) for s in etcds}, timeout)
        mgmtds = [s for s in services if s.argv[0] == "mgmtd"]
        pids = {s.name: startup.ensure(s) for s in mgmtds}  # the others register with it
        trio.run(wait_services_ready, cluster, pids, timeout)
        others = [s for s in services if s not in etcds and s not in mgmtds]
        pids.update({s.name: startup.ensure(s) for s in others})
        trio.run(wait_services_ready, cluster, pids, timeout)
        if mount_at is not None:
            mount_local(cluster, mount_at, startup, timeout)
    except BaseException as exc:
        raise startup.abort(exc) from None
    return cluster


def reconcile_shape(
    cluster: LocalCluster,
    storage_nodes: int | None,
    replicas: int | None,
    chunk_size: int | None,
    host: str | None,
    meta_servers: int | None = None,
    targets_per_node: int | None = None,
) -> list[str]:
    """Make an existing cluster the shape asked for, or say why not and
    how. Returns the storage nodes added."""
    layout = cluster.layout()
    d = cluster.dir
    if targets_per_node is not None and targets_per_node != layout.targets_per_node:
        raise UsageError(
            f"{d} was formatted with {layout.targets_per_node} targets per node; add targets "
            "to a node with `shufflefs target add` (or use a new --data-dir)"
        )
    if replicas is not None and replicas != layout.replicas:
        raise UsageError(
            f"{d} was formatted with {layout.replicas} replicas; the replica count is fixed "
            f"at format (use a new --data-dir for a cluster with {replicas})"
        )
    if host is not None and host != layout.host:
        raise UsageError(
            f"{d} listens on {layout.host}; --host {host} cannot move an existing cluster "
            "(use a new --data-dir)"
        )
    mgmtd_toml = d / "mgmtd" / "mgmtd.toml"
    current = load_checked(mgmtd_toml, service_config_class("mgmtd")).chunk_size
    if chunk_size is not None and chunk_size != current:
        raise UsageError(
            f"{d} makes new files with {current}-byte chunks; --chunk-size does not change "
            f"an existing cluster (set chunk_size in {mgmtd_toml}, then "
            f"`shufflefs down --data-dir {d}` and `shufflefs up --data-dir {d}`)"
        )
    if meta_servers is not None and meta_servers != layout.meta_servers:
        raise UsageError(
            f"{d} has {layout.meta_servers} metadata servers; --meta-servers is fixed at format "
            "(use a new --data-dir)"
        )
    have = len(layout.storage_ports)
    if storage_nodes is not None and storage_nodes < have:
        raise UsageError(
            f"{d} has {have} storage nodes; up does not remove nodes "
            f"(--storage-nodes {storage_nodes} asks for fewer)"
        )
    if storage_nodes is not None and storage_nodes > have:
        return cluster.add_storage_nodes(storage_nodes)
    return []


def mount_local(cluster: LocalCluster, mountpoint: Path, startup: Startup, timeout: float) -> None:
    out = startup.out
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
        raise UsageError(f"{mountpoint} already has a {fstype} filesystem mounted", errno.EBUSY)
    if pid is not None:
        procs.stop(proc)
    mountpoint.mkdir(parents=True, exist_ok=True)
    pid = startup.ensure(proc)
    try:
        wait_mounted(mountpoint, pid, timeout)
    except FsError as exc:
        if exc.code == errno.ECHILD:
            raise ServiceExited("mount", pid) from None
        if exc.code == errno.ETIMEDOUT:
            raise StartTimeout(timeout, f"{mountpoint} to be mounted") from None
        raise
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
        targets_per_node=args.targets_per_node,
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
        chunk_size=parse_size(args.chunk_size) if args.chunk_size is not None else None,
        host=args.host,
        meta_servers=args.meta_servers,
        targets_per_node=args.targets_per_node,
        ha=args.ha,
    )
    print(f"cluster up; client config: {cluster.client_config}")
    found = find_client_config().absolute()
    if CONFIG_ENV not in os.environ and found != cluster.client_config:
        print(f"  export SHUFFLEFS_CONFIG={cluster.client_config}")
    return 0


def cli_down(args: argparse.Namespace) -> int:
    down(args.data_dir)
    return 0
