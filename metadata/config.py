"""The metadata server's settings (a TOML file checked by `rpc.config.load_config`)."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from shufflefs.cluster.node import check_addresses
from shufflefs.rpc.errors import FsError


@dataclass
class MetaConfig:
    listen: str  # host:port the rpc server binds
    mgmtd: str  # host:port of the cluster manager
    data_dir: str  # the LMDB namespace and node.json live here
    secret_file: str  # the cluster secret (mode 0600)
    # The address registered with mgmtd, i.e. where clients connect. Defaults
    # to `listen`; set it when listening on a wildcard or behind NAT.
    advertise: str | None = None
    host: str | None = None  # machine name reported for locality (default: hostname)
    log_file: str | None = None
    log_level: str = "INFO"
    # Durable commits: every acknowledged mutation survives a power loss.
    # Without it a process crash is still safe, but a machine crash (power
    # loss, kernel panic) may lose the last commits or even corrupt the
    # namespace (LMDB's MDB_NOSYNC): for throwaway clusters and tests only.
    sync: bool = True
    session_timeout: float = 60.0  # seconds a client session lives without renewal
    map_size: int = 64 << 30  # LMDB address-space reservation: the namespace's size limit
    # How many metadata servers the group has (the majority a mutation needs
    # is counted from it, or from the registered ones if more). 1: this
    # server is its own primary, without a lease.
    group_size: int = 1
    # Log entries kept for a follower that is out of touch; one that missed
    # more copies a snapshot of the namespace instead.
    log_keep: int = 100_000
    metrics: str | None = None  # host:port of the Prometheus endpoint (default: none)

    def validate(self, where: str) -> None:
        """What the types of the TOML file cannot say (*where*: the file, for
        the message)."""
        if not self.session_timeout > 0:
            raise FsError(
                errno.EINVAL, f"{where}: session_timeout must be positive: {self.session_timeout}"
            )
        if self.map_size < 1 << 20:
            raise FsError(errno.EINVAL, f"{where}: map_size {self.map_size} is below 1 MiB")
        if self.group_size < 1:
            raise FsError(
                errno.EINVAL, f"{where}: group_size must be at least 1: {self.group_size}"
            )
        check_addresses(
            where,
            listen=self.listen,
            mgmtd=self.mgmtd,
            advertise=self.advertise,
            metrics=self.metrics,
        )
