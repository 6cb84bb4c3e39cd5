"""The storage daemon's settings (a TOML file read by `rpc.config.load_config`)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from shufflefs.cluster.node import check_addresses
from shufflefs.rpc.config import load_config
from shufflefs.rpc.errors import FsError
from shufflefs.storage.layout import check_block_size
from shufflefs.storage.protocol import FORWARD_TIMEOUT


@dataclass
class StorageConfig:
    listen: str  # host:port to serve rpc on (port 0: any free port)
    mgmtd: str  # host:port of the cluster manager
    data_dir: str  # node state: node.json (node_id, cluster_id)
    secret_file: str  # the cluster secret (mode 0600)
    targets: list[str]  # target directories, one per disk; formatted on first start
    advertise: str | None = None  # host:port others reach us at (default: from listen)
    host: str | None = None  # machine name reported for locality (default: hostname)
    log_file: str | None = None  # default: stderr
    log_level: str = "INFO"
    fsync: bool = True  # durable writes; false survives a process crash but not power loss
    reserve_bytes: int = 16 << 20  # free space kept back per target: below it writes get ENOSPC
    block_size: int = 4096  # CRC block size of NEW targets (an existing one keeps its own)
    io_threads: int = 16  # disk operations in flight at once
    fd_cache: int = 65536  # open chunk files kept per target (as many records are cached)
    forward_timeout: float = (
        FORWARD_TIMEOUT  # seconds per replica still ahead to wait for a forwarded update
    )
    scrub_interval: float = 0.0  # seconds between background scrubs of every target; 0: off
    metrics: str | None = None  # host:port of the Prometheus endpoint (default: none)

    def validate(self, where: str = "storage config") -> None:
        """Reject settings that would fail later in a less clear way (called
        by `load_config`: the daemon relies on it and checks nothing again)."""
        check_addresses(
            where,
            listen=self.listen,
            mgmtd=self.mgmtd,
            advertise=self.advertise,
            metrics=self.metrics,
        )
        if not self.targets:
            raise FsError(errno.EINVAL, f"{where}: 'targets' must list at least one directory")
        paths = [os.path.realpath(t) for t in self.targets]
        if len(set(paths)) != len(paths):
            raise FsError(errno.EINVAL, f"{where}: a target directory is listed twice")
        check_block_size(self.block_size)
        for name in ("io_threads", "fd_cache"):
            if getattr(self, name) < 1:
                raise FsError(errno.EINVAL, f"{where}: {name!r} must be at least 1")
        if self.forward_timeout <= 0:
            raise FsError(errno.EINVAL, f"{where}: 'forward_timeout' must be positive")
        if self.scrub_interval < 0:
            raise FsError(errno.EINVAL, f"{where}: 'scrub_interval' must not be negative")
        if self.reserve_bytes < 0:
            raise FsError(errno.EINVAL, f"{where}: 'reserve_bytes' must not be negative")


def load_storage_config(path: str | os.PathLike[str]) -> StorageConfig:
    return load_config(path, StorageConfig)
