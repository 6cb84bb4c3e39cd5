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
With ``--rounds N`` the fio jobs run N times, the places taking turns, and
each row gives its median with the spread: a ratio is taken within each
round (the peer measured minutes, not hours, from us), and the median and
range of those ratios are reported, since one round on a shared VM can be
off by a third.
Everything it started is stopped and removed at the end, on error and on
Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
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
    # with --rounds N > 1: the row is the round of median IOPS; the ratios
    # are the medians of each round's ratio; these give the spread
    rounds: int = 1
    iops_range: tuple[float, float] | None = None
    ratio_to_local_range: tuple[float, float] | None = None
    ratio_to_compare_range: tuple[float, float] | None = None


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
    rounds: int = 1,
) -> list[FioRow]:
    """The fio jobs through the mount (storage side warm: every replica of
    the file's chunks), on the local copy and on the --compare copy, with
    their ratios; *rounds* times, the places taking turns."""
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
    runs: dict[tuple[str, int], list[FioRow]] = defaultdict(list)
    for _ in range(max(1, rounds)):
        for where, path, netns in places:
            for jobs in FIO_JOBS:
                row = fio_randread(path, size, jobs, seconds, netns)
                row.where = where
                runs[(where, jobs)].append(row)
    return summarize(runs, places[2][0] if compare is not None else None)


def summarize(runs: dict[tuple[str, int], list[FioRow]], compared: str | None) -> list[FioRow]:
    """One row per (place, jobs) from its rounds: the round of median IOPS,
    each ratio the median of the ratios within each round (with their range
    when there were several rounds); of an even count, the lower median,
    so that every figure is one a round measured."""

    def ratios(key: tuple[str, int], base: str) -> list[float]:
        return [
            mine.iops / theirs.iops if theirs.iops else 0.0
            for mine, theirs in zip(runs[key], runs[(base, key[1])], strict=True)
        ]

    def spread(values: list[float]) -> tuple[float, float] | None:
        return (min(values), max(values)) if len(values) > 1 else None

    out = []
    for key, rows in runs.items():
        middle = sorted(rows, key=lambda r: r.iops)[(len(rows) - 1) // 2]
        to_local = ratios(key, "local")
        row = replace(
            middle,
            rounds=len(rows),
            iops_range=spread([r.iops for r in rows]),
            ratio_to_local=statistics.median_low(to_local),
            ratio_to_local_range=spread(to_local),
        )
        if compared is not None:
            to_compare = ratios(key, compared)
            row.ratio_to_compare = statistics.median_low(to_compare)
            row.ratio_to_compare_range = spread(to_compare)
        out.append(row)
    return out


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
                target,
                file_size,
                seconds,
                cluster.reader_netns(1),
                compare,
                workdir / "cluster",
                args.rounds,
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
        "fio_rounds": args.rounds,
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
    rounds = max((r.rounds for r in rows), default=1)
    how = f"; median of {rounds} rounds, [min-max]" if rounds > 1 else ""
    print(f"\nfio 4 KiB random reads, O_DIRECT (server side warm; local: the disk{how})", file=out)
    wide, rw = (18, 10) if rounds > 1 else (0, 0)
    print(
        f"{'where':<28} {'jobs':>4} {'IOPS':>10} {'':>{wide}}{'p50 us':>9} {'p99 us':>9} "
        f"{'x local':>{8 + rw}} {'x compare':>{9 + rw}}",
        file=out,
    )
    for r in rows:
        spread = f" [{r.iops_range[0]:,.0f}-{r.iops_range[1]:,.0f}]" if r.iops_range else ""
        local = _ratio(r.ratio_to_local, r.ratio_to_local_range)
        comp = _ratio(r.ratio_to_compare, r.ratio_to_compare_range)
        print(
            f"{r.where[:28]:<28} {r.jobs:>4} {r.iops:>10,.0f} {spread:>{wide}}{r.p50_us:>9,.1f} "
            f"{r.p99_us:>9,.1f} {local:>{8 + rw}} {comp:>{9 + rw}}",
            file=out,
        )


def _ratio(value: float | None, spread: tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + (f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread else "")
