"""A local cluster in the shape of a real deployment: each storage daemon on
its own network-namespace host, the readers (mount, native clients) on
other hosts, mgmtd and the metadata server in the root namespace on the
bridge (`netns.Hosts`).

A reader there cannot take the short circuit (`client/local_reads.py`): the
storage nodes report their own host names, so every read crosses a veth
link to a storage daemon, as it would from a training node. With a link
rate, each storage host's link is capped (`Hosts.cap`), so what a host can
serve is set by its link, as on a real cluster, not by the shared CPU.

Used by ``shufflefs bench --remote`` and by the tests of this topology.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from shufflefs.cluster import launcher, lifecycle, procs
from shufflefs.cluster.launcher import ClusterLayout, LocalCluster, wait_mounted
from shufflefs.cluster.netns import Hosts
from shufflefs.cluster.startup import START_TIMEOUT

log = logging.getLogger("shufflefs.cluster.netns_cluster")


def format_on_hosts(
    local: LocalCluster,
    hosts: Hosts,
    storage_nodes: int,
    replicas: int,
    chunk_size: int,
    mgmtd_settings: dict[str, object] | None = None,
    targets_per_node: int = 1,
) -> ClusterLayout:
    """Format *local* with storage node i on host i (1..storage_nodes) and
    mgmtd and the metadata server on the bridge address."""
    nodes = range(1, storage_nodes + 1)
    return local.format(
        storage_nodes,
        replicas,
        chunk_size,
        hosts.gateway,
        storage_hosts=[hosts.address(i) for i in nodes],
        storage_netns=[hosts.netns(i) for i in nodes],
        mgmtd_settings=mgmtd_settings,
        targets_per_node=targets_per_node,
    )


def mount_on_host(
    local: LocalCluster,
    mountpoint: Path,
    netns: str,
    timeout: float = START_TIMEOUT,
    options: str | None = None,
    name: str | None = None,
) -> int:
    """Mount *local* at *mountpoint* by a mount process running on host
    *netns* (seen by every process of this machine), with ``-o options``;
    returns its pid. Without *name* it is the cluster's mount, which
    `lifecycle.down` unmounts and stops; with one, a further mount with its
    own pid and log files (``NAME.pid``, ``NAME.log``), the caller's to stop."""
    proc = local.mount_process(mountpoint)
    argv = proc.argv
    if name:
        log_at = argv.index("--log-file") + 1
        argv = (*argv[:log_at], str(local.logs / f"{name}.log"), *argv[log_at + 1 :])
        proc = replace(
            proc,
            name=name,
            pid_file=local.run / f"{name}.pid",
            out_file=local.logs / f"{name}.out",
        )
    if options:
        argv = (*argv[:-1], "-o", options, argv[-1])
    proc = replace(proc, argv=argv, netns=netns)
    mountpoint.mkdir(parents=True, exist_ok=True)
    pid = procs.start(proc)
    try:
        wait_mounted(mountpoint, pid, timeout)
    except BaseException:
        procs.stop(proc)
        raise
    if not name:
        (local.run / "mountpoint").write_text(f"{mountpoint}\n")
    return pid


class RemoteCluster:
    """*storage_hosts* storage hosts (h1..hK) and *reader_hosts* reader
    hosts (hK+1..) on one bridge; `start` creates the hosts, caps the storage
    links (*link_rate* bytes/s each way, None: uncapped), formats a cluster
    under *workdir* and starts its services; `stop` (or leaving the `with`)
    stops every process, removes every namespace, link and queue, and the
    data, whatever state the start got to."""

    def __init__(
        self,
        workdir: Path,
        storage_hosts: int,
        reader_hosts: int = 1,
        *,
        replicas: int = 1,
        chunk_size: int = launcher.DEFAULT_CHUNK_SIZE,
        link_rate: int | None = None,
        mgmtd_settings: dict[str, object] | None = None,
        targets_per_node: int = 1,
    ) -> None:
        self.workdir = workdir
        self.targets_per_node = targets_per_node
        self.storage_hosts = storage_hosts
        self.reader_hosts = reader_hosts
        self.replicas = replicas
        self.chunk_size = chunk_size
        self.link_rate = link_rate
        self.mgmtd_settings = mgmtd_settings
        self.hosts = Hosts(storage_hosts + reader_hosts)
        self.local = LocalCluster(workdir / "cluster")

    @property
    def client_config(self) -> Path:
        return self.local.client_config

    def reader_netns(self, j: int = 1) -> str:
        """The namespace of reader host j (1-based)."""
        assert 1 <= j <= self.reader_hosts
        return self.hosts.netns(self.storage_hosts + j)

    def readers_netns(self) -> list[str]:
        return [self.reader_netns(j) for j in range(1, self.reader_hosts + 1)]

    def start(self) -> None:
        try:
            self.hosts.create()
            if self.link_rate is not None:
                for i in range(1, self.storage_hosts + 1):
                    self.hosts.cap(i, self.link_rate)
            format_on_hosts(
                self.local,
                self.hosts,
                self.storage_hosts,
                self.replicas,
                self.chunk_size,
                self.mgmtd_settings,
                self.targets_per_node,
            )
            lifecycle.up(self.local.dir, None, out=io.StringIO())
        except BaseException:
            self.stop()
            raise

    def mount(self, mountpoint: Path, reader: int = 1) -> int:
        """Mount the cluster at *mountpoint* from reader host *reader*. Its
        metrics are served on that host's address: the client config names
        the bridge's, which only this machine's own host has, so the mount
        serves at its own address toward mgmtd (`start_client_metrics`), as
        a mount on a training node of a real cluster does."""
        return mount_on_host(self.local, mountpoint, self.reader_netns(reader))

    def stop(self) -> None:
        with uninterrupted():
            try:
                if self.local.exists():
                    lifecycle.down(self.local.dir, out=io.StringIO())
            except Exception as exc:  # still remove the hosts and the data
                log.warning("stopping the cluster in %s: %s", self.local.dir, exc)
            finally:
                self.hosts.destroy()
                shutil.rmtree(self.local.dir, ignore_errors=True)

    def __enter__(self) -> RemoteCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C ignored meanwhile (a second one must not leave hosts behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
