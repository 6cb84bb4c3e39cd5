"""``shufflefs bench files --remote``: the one-file-per-sample benchmark from
a reader that is not a storage host, in a real deployment's shape.

It starts a cluster whose storage daemons run on their own network-namespace
hosts (`cluster/netns_cluster.py`: mgmtd and the metadata server on the
bridge) and puts everything that reads on one reader host: every mount of
the run (the default one, ``-o ro``, ``-o writeback``,
``cache=immutable``) and every worker process, the local directory's
rows included, so that both sides of each ratio run in the same place.
Every byte read through shufflefs then crosses a veth link to a storage
daemon, as from a training node: none can take the short circuit
(`client/local_reads.py`), which is what the figures on a storage host
measure. Everything it starts is stopped and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shufflefs.cluster.launcher import free_ports
from shufflefs.cluster.lifecycle import MOUNT_STOP_SECONDS, unmount_reporting
from shufflefs.cluster.netns import namespaces_available
from shufflefs.cluster.netns_cluster import RemoteCluster, mount_on_host
from shufflefs.cluster.procs import stop_pid

# what --remote decides itself (a cluster and mounts of its own)
EXCLUSIVE = ("mount", "ro_mount", "prefetch_mount", "embedded", "config")


@dataclass
class RemoteRun:
    """The cluster of one run and where its readers are."""

    cluster: RemoteCluster

    @property
    def netns(self) -> str:
        return self.cluster.reader_netns(1)

    @property
    def address(self) -> str:
        """The reader host's address: where its mounts serve their metrics
        (its loopback is not this machine's)."""
        return self.cluster.hosts.address(self.cluster.storage_hosts + 1)

    def settings(self) -> dict[str, object]:
        return {
            "storage_hosts": self.cluster.storage_hosts,
            "replicas": self.cluster.replicas,
            "reader_host": self.netns,
        }

    def note(self) -> str:
        c = self.cluster
        return (
            f"remote: {c.storage_hosts} storage hosts, {c.replicas} replicas; "
            f"every mount and worker on reader host {self.netns} (no short circuit)"
        )


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming what --remote cannot be combined with or needs."""
    given = [f"--{name.replace('_', '-')}" for name in EXCLUSIVE if getattr(args, name, None)]
    if given:
        raise ValueError(f"--remote starts a cluster of its own: drop {', '.join(given)}")
    if args.replicas is not None and args.replicas > args.storage_hosts:
        raise ValueError(f"--replicas {args.replicas} needs as many --storage-hosts")
    why_not = namespaces_available()
    if why_not is not None:
        raise ValueError(f"--remote needs network namespaces: {why_not}")


def start(
    args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack
) -> tuple[RemoteRun, str, Path]:
    """Start the hosts and the cluster, mount it on the reader host: (the
    run, the client config, the mount point); all undone by *stack*."""
    check_args(args)
    replicas = args.replicas or min(3, args.storage_hosts)
    cluster = stack.enter_context(
        RemoteCluster(workdir / "remote", args.storage_hosts, 1, replicas=replicas)
    )
    mountpoint = workdir / "mnt"
    cluster.mount(mountpoint)
    return RemoteRun(cluster), str(cluster.client_config), mountpoint


@contextlib.contextmanager
def option_mount(run: RemoteRun, mountpoint: Path, options: str) -> Iterator[Path]:
    """A further mount ``-o OPTIONS`` on the reader host, unmounted after."""
    name = f"mount-{mountpoint.name}"
    pid = mount_on_host(run.cluster.local, mountpoint, run.netns, options=options, name=name)
    try:
        yield mountpoint
    finally:
        unmount_reporting(mountpoint, io.StringIO())
        # (its SIGTERM finishes what it owes the cluster: -o writeback's closes)
        stop_pid(pid, MOUNT_STOP_SECONDS)


def metrics_address(run: RemoteRun | None) -> str:
    """``host:port`` for a mount's metrics that this machine can scrape."""
    host = run.address if run is not None else "127.0.0.1"
    [port] = free_ports("127.0.0.1", 1)  # (a port free here; the reader host's are all free)
    return f"{host}:{port}"
