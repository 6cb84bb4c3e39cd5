"""Configuration of mgmtd and of clients (what `shufflefs format`/`up` write)."""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from shufflefs.cluster.node import check_addresses
from shufflefs.rpc.cluster_secret import load_secret
from shufflefs.rpc.config import load_config
from shufflefs.rpc.errors import FsError


@dataclass
class MgmtdConfig:
    listen: str  # host:port to serve on
    data_dir: str  # the LMDB holding the cluster's membership, targets and chains
    secret_file: str
    advertise: str | None = None  # address others reach us at (default: listen)
    host: str | None = None  # machine name (default: hostname)
    log_file: str | None = None
    log_level: str = "INFO"
    # Cluster settings. `replicas` is fixed when the cluster is formatted;
    # the others may be changed here and apply from the next start.
    replicas: int = 1
    min_replicas: int | None = None  # default: min(2, replicas)
    chunk_size: int = 1 << 20
    stripe: int = 16
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    # The HA control plane: etcd endpoints (host:port of each member's client
    # URL). Empty: the embedded default (state in data_dir's LMDB, one mgmtd).
    etcd: list[str] = field(default_factory=list)
    etcd_prefix: str = "/shufflefs"  # keys of this cluster in etcd
    election_ttl: int = 3  # seconds of the primary's etcd lease
    # host:port of the status page and Prometheus endpoint (default: none)
    metrics: str | None = None
    # the first chain table waits for this many storage nodes to register
    # (0: builds as soon as `replicas` nodes are there); `format` sets it
    initial_nodes: int = 0
    # re-replicate a storage node all of whose targets stayed offline this
    # many seconds (0 or less: never); not while more than
    # `replace_max_offline` storage nodes are offline; at most
    # `replace_parallel` of its chains copying at once (`cluster/replace.py`)
    replace_offline_after: float = 600.0
    replace_max_offline: int = 1
    replace_parallel: int = 4

    @property
    def effective_min_replicas(self) -> int:
        return self.min_replicas if self.min_replicas is not None else min(2, self.replicas)

    def validate(self, where: str) -> None:
        check_addresses(where, listen=self.listen, advertise=self.advertise, metrics=self.metrics)
        cs = self.chunk_size
        if cs < 4096 or cs > 64 << 20 or cs & (cs - 1):
            raise FsError(errno.EINVAL, f"{where}: chunk_size must be a power of two, 4K..64M")
        if not 1 <= self.replicas <= 16:
            raise FsError(errno.EINVAL, f"{where}: replicas must be 1..16")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise FsError(errno.EINVAL, f"{where}: min_replicas must be 1..replicas")
        if self.stripe < 1:
            raise FsError(errno.EINVAL, f"{where}: stripe must be at least 1")
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise FsError(errno.EINVAL, f"{where}: need 0 < heartbeat_interval < heartbeat_timeout")
        for endpoint in self.etcd:
            check_addresses(f"{where}: etcd", listen="0.0.0.0:0", advertise=endpoint)
        if not 2 <= self.election_ttl <= 60:
            raise FsError(errno.EINVAL, f"{where}: election_ttl must be 2..60 seconds")
        if self.initial_nodes < 0:
            raise FsError(errno.EINVAL, f"{where}: initial_nodes must be >= 0")
        if not math.isfinite(self.replace_offline_after):
            raise FsError(
                errno.EINVAL, f"{where}: replace_offline_after must be seconds (0 or less: off)"
            )
        if self.replace_max_offline < 1:
            raise FsError(errno.EINVAL, f"{where}: replace_max_offline must be at least 1")
        if not 1 <= self.replace_parallel <= 1024:
            raise FsError(errno.EINVAL, f"{where}: replace_parallel must be 1..1024")


CONFIG_ENV = "SHUFFLEFS_CONFIG"
DEFAULT_DATA_DIR = ".shufflefs"  # where `shufflefs format`/`up` put a local cluster
DEFAULT_CLIENT_CONFIG = Path(DEFAULT_DATA_DIR) / "client.toml"


def find_client_config(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The client config to use, in the one order every command and API
    follows: *explicit* (``--config``, ``config=``), else
    ``$SHUFFLEFS_CONFIG``, else ``./.shufflefs/client.toml``."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else DEFAULT_CLIENT_CONFIG


@dataclass
class ClientConfig:
    """What a client (mount, native client, CLI) needs to find the cluster."""

    mgmtd: str  # host:port
    secret_file: str  # relative paths are relative to this file's folder
    log_file: str | None = None
    log_level: str = "INFO"
    # host:port of the mount's Prometheus endpoint (port 0: any free port; default: none)
    mount_metrics: str | None = None


def load_client_config(path: str | Path) -> tuple[ClientConfig, bytes]:
    """Read a client config and the cluster secret it points at."""
    path = Path(path)
    config = load_config(path, ClientConfig)
    secret_path = Path(config.secret_file)
    if not secret_path.is_absolute():
        secret_path = path.parent / secret_path
    return config, load_secret(secret_path)
