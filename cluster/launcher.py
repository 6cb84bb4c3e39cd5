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

import errno
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shufflefs.cluster import procs
from shufflefs.cluster.cli_errors import UsageError
from shufflefs.cluster.config import ClientConfig
from shufflefs.cluster.etcd_procs import EtcdMembers, etcd_program
from shufflefs.cluster.preflight import (
    check_dir_for_writing,
    check_service_paths,
    checked_dict,
    load_checked,
    load_client,
    mounted_fstype,
    service_config_class,
)
from shufflefs.rpc.cluster_secret import generate_secret
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
            configs[self.meta_dir(i) / "meta.toml"] = self._meta_settings(layout, i, next(metrics))
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

    def _meta_settings(
        self, layout: ClusterLayout, i: int, metrics_port: int
    ) -> tuple[dict[str, Any], type[Any]]:
        """meta{i}/meta.toml of *layout*, its metrics at *metrics_port*."""
        settings: dict[str, Any] = (
            {"group_size": layout.meta_servers} if layout.meta_servers > 1 else {}
        )
        metrics = f"{layout.host}:{metrics_port}"
        if layout.meta_hosts:
            settings["host"] = f"meta-host{i}"
            metrics = f"{layout.meta_hosts[i - 1]}:{NETNS_META_PORT + 1}"
        data = {
            "listen": layout.meta_address(i),
            "mgmtd": layout.mgmtd_address,
            "data_dir": str(self.meta_dir(i) / "db"),
            "log_file": str(self.logs / f"{meta_name(i)}.log"),
            **settings,
            "metrics": metrics,
            "secret_file": str(self.secret_file),
            "log_level": "INFO",
        }
        return data, service_config_class("meta")

    def add_meta_server(self) -> str:
        """One more metadata server (configs only: `up` starts it; it
        registers, and the primary brings it up to date with a snapshot of
        the namespace and then the log). The others' `group_size` follows at
        their next start (running, they count the registered servers)."""
        layout = self.layout()
        if layout.meta_hosts:
            raise UsageError(
                f"{self.dir}: its metadata servers run on their own test hosts; "
                "meta add cannot add one to it"
            )
        if layout.meta_servers == 1:
            raise UsageError(
                f"{self.dir} has one metadata server, which runs alone without a lease; a group "
                "is formatted with `up --meta-servers 3` (use a new --data-dir)"
            )
        port, metrics = free_ports(layout.host, 2)
        layout.meta_ports = [*layout.meta_ports, port]
        n = layout.meta_servers
        configs = {self.meta_dir(n) / "meta.toml": self._meta_settings(layout, n, metrics)}
        for i in range(1, n):
            path = self.meta_dir(i) / "meta.toml"
            data = load_checked(path, service_config_class("meta")).__dict__.copy()
            data["group_size"] = n
            configs[path] = (
                {k: v for k, v in data.items() if v is not None},
                service_config_class("meta"),
            )
        configs[self.layout_file] = (layout.__dict__, ClusterLayout)
        self.check_new_configs(configs)
        for path, (data, _) in configs.items():
            write_toml(path, data)
        return meta_name(n)

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
