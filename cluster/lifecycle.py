"""`shufflefs up`, `down` and `format`: bringing a local cluster (the one
`LocalCluster` describes) to life and back, reconciling a changed shape,
and mounting it. The layout and the services themselves are
`cluster/launcher.py`'s."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster import procs
from shufflefs.cluster.cli_errors import StartFailed, UsageError
from shufflefs.cluster.config import CONFIG_ENV, find_client_config
from shufflefs.cluster.etcd_procs import wait_healthy
from shufflefs.cluster.launcher import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_HOST,
    DEFAULT_STORAGE_NODES,
    HA_MGMTDS,
    LocalCluster,
    default_replicas,
    unmount,
    wait_mounted,
)
from shufflefs.cluster.preflight import (
    check_mountpoint,
    load_checked,
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
    wait_writable,
)
from shufflefs.rpc.errors import FsError

FORMAT_ATTEMPTS = 3  # a fresh cluster whose picked port was taken meanwhile: format again


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
    for attempt in range(1, FORMAT_ATTEMPTS + 1):
        formatted_over: set[Path] | None = None  # what data_dir held before this call formatted it
        if cluster.exists():
            if ha and not cluster.layout().ha:
                raise UsageError(
                    f"{cluster.dir} was formatted without --ha (one mgmtd); the control plane "
                    "is fixed at format (use a new --data-dir for an HA cluster)"
                )
            added = reconcile_shape(
                cluster, storage_nodes, replicas, chunk_size, host, meta_servers, targets_per_node
            )
            if added:
                names = ", ".join(added)
                print(
                    f"added {names}; mgmtd places their targets (see `shufflefs status`)",
                    file=out,
                )
        else:
            formatted_over = set(cluster.dir.iterdir()) if cluster.dir.is_dir() else set()
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
            start_and_mount(cluster, startup, mount_at, timeout, out)
            return cluster
        except BaseException as exc:
            report = startup.abort(exc)
            taken = port_taken(report)
            if formatted_over is None or attempt == FORMAT_ATTEMPTS or taken is None:
                raise report from None
        # The ports were free when format picked them, and something (another
        # program's outgoing connection, often) took one before its service
        # bound it. A cluster this call formatted holds nothing yet: format it
        # again, on ports picked now.
        print(f"{taken}; formatting again on other ports", file=out)
        unformat(cluster.dir, formatted_over)
    raise AssertionError("unreachable")  # the last attempt returns or raises


def start_and_mount(
    cluster: LocalCluster, startup: Startup, mount_at: Path | None, timeout: float, out: Any
) -> None:
    """Start what is not running, in order, wait until it is ready, and mount."""
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
    missing = trio.run(wait_writable, cluster, pids, timeout)
    if missing is not None:
        print(
            f"warning: still waiting for {missing} after {timeout:g}s: new files are "
            "refused (EROFS) until then; `shufflefs status` shows the targets",
            file=out,
        )
    if mount_at is not None:
        mount_local(cluster, mount_at, startup, timeout)


def port_taken(report: BaseException) -> str | None:
    """*report*'s message if `up` failed because a service found its port
    taken (ours say "Address already in use", etcd "bind: address already
    in use")."""
    taken = os.strerror(errno.EADDRINUSE).lower()
    if isinstance(report, StartFailed) and taken in report.message.lower():
        return report.message
    return None


def unformat(data_dir: Path, before: set[Path]) -> None:
    """Remove what a format wrote into *data_dir* (all but *before*)."""
    for entry in data_dir.iterdir():
        if entry in before:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


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


MOUNT_STOP_SECONDS = 60.0  # a mount's SIGTERM, then SIGKILL


def down(data_dir: str | Path, out: Any = sys.stdout) -> None:
    cluster = LocalCluster(data_dir)
    cluster.layout()  # a clear error if this is not a cluster
    mountpoint = cluster.recorded_mountpoint()
    if mountpoint is not None:
        unmount_reporting(mountpoint, out)
        # (a mount's SIGTERM finishes what it owes the cluster: -o writeback's closes)
        if procs.stop(cluster.mount_process(mountpoint), MOUNT_STOP_SECONDS):
            print("stopped mount", file=out)
        with contextlib.suppress(OSError):
            (cluster.run / "mountpoint").unlink()
    for pid, other in other_mounts(cluster):
        # `shufflefs mount --config <this cluster's>` elsewhere: left running,
        # it would answer ENOTCONN for good once the servers are gone
        unmount_reporting(other, out)
        procs.stop_pid(pid, MOUNT_STOP_SECONDS)
    for service in reversed(cluster.services()):
        if procs.stop(service):
            print(f"stopped {service.name}", file=out)


def unmount_reporting(mountpoint: Path, out: Any) -> None:
    """Unmount a shufflefs mount if it is one (lazily if it is busy)."""
    if mounted_fstype(mountpoint) != "fuse.shufflefs":
        return
    try:
        unmount(mountpoint)
    except FsError as exc:
        print(f"warning: {exc.message}; detaching {mountpoint} lazily", file=out)
        unmount(mountpoint, lazy=True)
    print(f"unmounted {mountpoint}", file=out)


def other_mounts(cluster: LocalCluster) -> list[tuple[int, Path]]:
    """(pid, mount point) of each mount process of this cluster's client
    config other than `up`'s (`shufflefs mount` runs them as ``mount
    --foreground --config CONFIG ... MOUNTPOINT``)."""
    recorded = cluster.recorded_mountpoint()
    ours = cluster.client_config.resolve()
    found = []
    for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()):
        words = procs.argv(pid)
        if "shufflefs.cluster.cli" not in words or "--config" not in words:
            continue
        at = words.index("--config")
        if words[at - 2 : at] != ["mount", "--foreground"] or at + 1 >= len(words):
            continue
        mountpoint = Path(words[-1])
        if Path(words[at + 1]).resolve() == ours and mountpoint != recorded:
            found.append((pid, mountpoint))
    return found


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
