"""A local etcd cluster as processes: what `shufflefs up --ha` and the HA
tests run mgmtd's coordination on (cluster/coordination_etcd.py).

Each member is Debian's ``etcd`` (package etcd-server) on loopback with its
own client and peer port and its own data dir, run like every other local
service (`procs.ServiceProcess`: a pid file, its output in a log, stopped
by pid). On the first start the members form a new cluster from the list of
peers; on later starts etcd ignores that list and rejoins from its data
dir, so the same command line serves both.
"""

from __future__ import annotations

import errno
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from shufflefs.cluster import procs
from shufflefs.rpc.errors import FsError

ETCD = "etcd"
CLUSTER_TOKEN = "shufflefs"
# raft timing for loopback: a dead leader is replaced within ~1 s
HEARTBEAT_MS = 100
ELECTION_MS = 1000
HEALTH_POLL = 0.2


def etcd_program() -> str:
    """The etcd binary, or a one-line error naming the package."""
    found = shutil.which(ETCD)
    if found is None:
        raise FsError(
            errno.ENOENT, "etcd is not installed (Debian package etcd-server, /usr/bin/etcd)"
        )
    return found


@dataclass(frozen=True)
class EtcdMembers:
    """The members of one etcd cluster: *client_ports[i]* and *peer_ports[i]*
    of member ``etcd{i+1}``, its data in *data_dir*/etcd{i+1}."""

    host: str
    client_ports: list[int]
    peer_ports: list[int]
    data_dir: Path
    log_dir: Path
    run_dir: Path

    @property
    def names(self) -> list[str]:
        return [f"etcd{i + 1}" for i in range(len(self.client_ports))]

    @property
    def endpoints(self) -> list[str]:
        """host:port of each member's client URL (mgmtd's ``etcd`` setting)."""
        return [f"{self.host}:{p}" for p in self.client_ports]

    def member_dir(self, i: int) -> Path:
        return self.data_dir / self.names[i]

    def argv(self, i: int) -> tuple[str, ...]:
        initial = ",".join(
            f"{n}=http://{self.host}:{p}" for n, p in zip(self.names, self.peer_ports, strict=True)
        )
        client = f"http://{self.host}:{self.client_ports[i]}"
        peer = f"http://{self.host}:{self.peer_ports[i]}"
        return (
            f"--name={self.names[i]}",
            f"--data-dir={self.member_dir(i)}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={CLUSTER_TOKEN}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
        )

    def service(self, i: int) -> procs.ServiceProcess:
        """Member *i* (0-based) as a service: recognized by its data dir."""
        name = self.names[i]
        return procs.ServiceProcess(
            name=name,
            argv=self.argv(i),
            marker=f"--data-dir={self.member_dir(i)}",
            pid_file=self.run_dir / f"{name}.pid",
            out_file=self.log_dir / f"{name}.log",  # etcd logs to stderr
            # resolved when started; `down` must work even if etcd was removed
            program=(shutil.which(ETCD) or ETCD,),
        )

    def services(self) -> list[procs.ServiceProcess]:
        return [self.service(i) for i in range(len(self.client_ports))]


def unhealthy(endpoint: str) -> str | None:
    """Why the member at *endpoint* is not serving yet (None: it is, and
    it knows a raft leader)."""
    import etcd3gw  # a mgmtd dependency; imported here so the launcher starts fast
    from etcd3gw import exceptions as etcd_errors

    host, port = endpoint.rsplit(":", 1)
    try:
        status = etcd3gw.client(host=host, port=int(port), timeout=1).status()
    except (etcd_errors.Etcd3Exception, OSError) as exc:
        return f"etcd at {endpoint} to answer ({type(exc).__name__})"
    if not int(status.get("leader", 0) or 0):
        return f"etcd at {endpoint} to elect a leader"
    return None


def wait_healthy(members: EtcdMembers, pids: dict[str, int], timeout: float) -> None:
    """Wait until every member in *pids* answers with a leader known;
    ServiceExited-like FsError(ECHILD) at once if one of them dies."""
    from shufflefs.cluster.startup import ServiceExited, StartTimeout

    deadline = time.monotonic() + timeout
    endpoints = dict(zip(members.names, members.endpoints, strict=True))
    while True:
        waiting = None
        for name, pid in pids.items():
            if not procs.alive(pid):
                raise ServiceExited(name, pid)
            waiting = waiting or unhealthy(endpoints[name])
        if waiting is None:
            return
        if time.monotonic() > deadline:
            raise StartTimeout(timeout, waiting)
        time.sleep(HEALTH_POLL)
