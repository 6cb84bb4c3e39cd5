"""`shufflefs bench --remote`: the same benchmark from a reader that is not a
storage host, in the real deployment's shape, set up and torn down by the run.

It starts a cluster whose storage daemons run on their own network-namespace
hosts (`cluster/netns_cluster.py`) and runs every reader process, and the
FUSE mount, on other hosts, so every read crosses a veth link to a storage
daemon and none can take the short circuit. With ``--link-mbps`` each
storage host's link is capped with `tc` (what a host serves is then set by
its link, as on a real cluster, not by the shared CPU). It measures the rows
of ``shufflefs bench`` (local file baseline beside them, same run), then fio
4 KiB O_DIRECT random reads at 1 and 8 jobs through the mount on the reader
host, beside the same fio jobs on the local copy (O_DIRECT: the disk) and,
with ``--compare DIR``, on a copy in another filesystem (a MooseFS mount).
Everything it started is stopped and removed at the end, on error and on
Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from shufflefs.client.iobench import (
    MiB,
    Target,
    caches_of,
    check_workloads,
    measure,
    read_whole,
    render,
    seconds_of,
    test_file,
)
from shufflefs.cluster.cli_errors import UsageError
from shufflefs.cluster.netns import enter_command, namespaces_available
from shufflefs.cluster.netns_cluster import RemoteCluster
from shufflefs.cluster.preflight import mounted_fstype

FIO_JOBS = (1, 8)
FIO_TIMEOUT_SLACK = 30.0  # seconds past a job's runtime before it is given up


@dataclass
class FioRow:
    where: str  # shufflefs (through the mount on a reader host), local, or the --compare label
    jobs: int
    iops: float
    p50_us: float
    p99_us: float
    ratio_to_local: float | None = None
    ratio_to_compare: float | None = None


def fio_randread(path: str, size: int, jobs: int, seconds: float, netns: str | None) -> FioRow:
    """fio 4 KiB random reads with O_DIRECT (each one reaches the
    filesystem) on *path*, from host *netns* (None: this one)."""
    cmd = [
        *enter_command(netns),
        "fio",
        "--name=randread4k",
        f"--filename={path}",
        f"--size={size}",
        "--rw=randread",
        "--bs=4k",
        "--direct=1",
        "--ioengine=psync",
        "--invalidate=0",
        f"--numjobs={jobs}",
        "--group_reporting",
        "--time_based",
        "--ramp_time=1",
        f"--runtime={max(1, round(seconds))}",
        "--output-format=json",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=seconds + FIO_TIMEOUT_SLACK + 1
    )
    if done.returncode != 0:
        raise RuntimeError(f"fio on {path} failed: {done.stderr.strip()[-500:]}")
    read = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]["read"]
    pct = read["clat_ns"]["percentile"]
    return FioRow(
        "",
        jobs,
        float(read["iops"]),
        pct["50.000000"] / 1e3,
        pct["99.000000"] / 1e3,
    )


def warm_replicas(cluster_dir: Path) -> None:
    """Read every chunk file of every target into the page cache. A read
    through the mount warms one replica per chain, but concurrent reads are
    spread over every replica by load, and the cold rows dropped the caches:
    "storage side warm" means all of them."""
    for path in sorted(cluster_dir.glob("storage*/**/chunks/**/*")):
        if path.is_file():
            with contextlib.suppress(OSError), open(path, "rb") as f:
                while f.read(1 << 20):
                    pass


def fio_rows(
    target: Target,
    size: int,
    seconds: float,
    reader_netns: str,
    compare: Path | None,
    cluster_dir: Path | None = None,
) -> list[FioRow]:
    """The fio jobs through the mount (storage side warm: every replica of
    the file's chunks), on the local copy and on the --compare copy, with
    their ratios."""
    assert target.fuse_file is not None
    read_whole(target.fuse_file)  # warms the storage daemons' page cache
    if cluster_dir is not None:
        warm_replicas(cluster_dir)
    places: list[tuple[str, str, str | None]] = [
        ("shufflefs", target.fuse_file, reader_netns),
        ("local", target.local_file, None),
    ]
    if compare is not None:
        places.append((compare_label(compare), str(compare / Path(target.local_file).name), None))
    rows = []
    for where, path, netns in places:
        for jobs in FIO_JOBS:
            row = fio_randread(path, size, jobs, seconds, netns)
            row.where = where
            rows.append(row)
    by = {(r.where, r.jobs): r.iops for r in rows}
    for r in rows:
        r.ratio_to_local = r.iops / by[("local", r.jobs)]
        if compare is not None:
            r.ratio_to_compare = r.iops / by[(places[2][0], r.jobs)]
    return rows


def compare_label(directory: Path) -> str:
    """The --compare directory named by its filesystem (as mounted)."""
    probe = directory.absolute()
    while True:
        fstype = mounted_fstype(probe)
        if fstype is not None or probe.parent == probe:
            return f"{fstype or 'dir'}:{directory}"
        probe = probe.parent


@contextlib.contextmanager
def compare_copy(source: str, directory: Path | None) -> Iterator[None]:
    """A copy of the test file in the --compare directory, removed after."""
    if directory is None:
        yield
        return
    copy = directory / Path(source).name
    shutil.copyfile(source, copy)
    try:
        read_whole(str(copy))  # that filesystem's server side warm too
        yield
    finally:
        with contextlib.suppress(OSError):
            copy.unlink()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds the run like Ctrl-C, so the teardown runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_remote_args(args: argparse.Namespace) -> Path | None:
    why_not = namespaces_available()
    if why_not is not None:
        raise UsageError(f"--remote needs network namespaces: {why_not}")
    if args.replicas is not None and args.replicas > args.storage_hosts:
        raise UsageError(f"--replicas {args.replicas} needs as many --storage-hosts")
    check_workloads(args)
    if args.compare is None:
        return None
    compare = Path(args.compare).absolute()
    if not compare.is_dir():
        raise UsageError(f"--compare {args.compare}: not a directory")
    return compare


def cli_remote(args: argparse.Namespace) -> int:
    compare = check_remote_args(args)
    file_size = (args.size_mb or (64 if args.quick else 256)) * MiB
    seconds = seconds_of(args)
    replicas = args.replicas or min(3, args.storage_hosts)
    rate = int(args.link_mbps * 1e6) if args.link_mbps else None
    run_fio = not args.no_fio and shutil.which("fio") is not None
    fio: list[FioRow] = []
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        workdir = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="shufflefs-remote-", dir=args.local_dir)
            )
        )
        cluster = stack.enter_context(
            RemoteCluster(
                workdir, args.storage_hosts, args.reader_hosts, replicas=replicas, link_rate=rate
            )
        )
        mountpoint = workdir / "mnt"
        cluster.mount(mountpoint)
        target = stack.enter_context(
            test_file(
                args,
                str(cluster.client_config),
                mountpoint,
                workdir,
                file_size,
                netns=tuple(cluster.readers_netns()),
            )
        )
        rows = measure(args, target, file_size)
        if run_fio:
            stack.enter_context(compare_copy(target.local_file, compare))
            fio = fio_rows(
                target, file_size, seconds, cluster.reader_netns(1), compare, workdir / "cluster"
            )
    settings = {
        "file_mb": file_size // MiB,
        "seconds_per_row": seconds,
        "batch": args.batch,
        "cold": "cold" in caches_of(args),
        "storage_hosts": args.storage_hosts,
        "reader_hosts": args.reader_hosts,
        "replicas": replicas,
        "link_mbps": args.link_mbps,
        "readers": args.readers,
    }
    if args.json:
        out = {"settings": settings, "rows": [asdict(r) for r in rows]}
        out["fio"] = [asdict(r) for r in fio]
        print(json.dumps(out, indent=2))
        return 0
    link = f"links capped at {args.link_mbps:g} MB/s each way" if rate else "links uncapped"
    print(
        f"remote topology: {args.storage_hosts} storage host(s) ({link}), "
        f"{args.reader_hosts} reader host(s), replicas {replicas}; readers and the mount "
        "on reader hosts (no short circuit)"
    )
    render(rows)
    if fio:
        render_fio(fio)
    return 0


def render_fio(rows: list[FioRow], out: Any = sys.stdout) -> None:
    print("\nfio 4 KiB random reads, O_DIRECT (server side warm; local: the disk)", file=out)
    print(
        f"{'where':<28} {'jobs':>4} {'IOPS':>10} {'p50 us':>9} {'p99 us':>9} "
        f"{'x local':>8} {'x compare':>9}",
        file=out,
    )
    for r in rows:
        local = f"{r.ratio_to_local:.2f}" if r.ratio_to_local is not None else "-"
        comp = f"{r.ratio_to_compare:.2f}" if r.ratio_to_compare is not None else "-"
        print(
            f"{r.where[:28]:<28} {r.jobs:>4} {r.iops:>10,.0f} {r.p50_us:>9,.1f} "
            f"{r.p99_us:>9,.1f} {local:>8} {comp:>9}",
            file=out,
        )
