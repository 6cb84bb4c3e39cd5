"""`shufflefs bench`: random-read IOPS and latency, four ways in, side by side.

Every row runs the same reads of the same bytes, in the same run, through:

    local         os.pread on a copy of the file on a local disk: the physical limit
    fuse          os.pread on the file in the shufflefs mount
    native        the native client, one read per call
    native-batch  the native client, many reads per call (grouped per storage node)

Workloads: rand4k (4 KiB at 4 KiB-aligned random offsets), rand2k (2 KiB at
token-aligned random offsets: a 1024-token window of uint16), rand128k, and
seq1m (1 MiB sequential, each reader from its own start). Each at 1 reader
and at N reader processes. Cold rows drop the page caches first (as root:
``echo 3 > /proc/sys/vm/drop_caches``, which also empties the storage
daemons' caches on this machine) and read with O_DIRECT on local and FUSE,
so no read is served by the kernel cache of this node; warm rows read a
file that was read whole just before. Each row reports IOPS, MB/s, p50 and
p99 latency (per call: one read, or one batch for native-batch) and the ratio
of its IOPS to the local row with the same workload, readers and cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from shufflefs.cluster.launcher import LocalCluster

PATHS = ("local", "fuse", "native", "native-batch")
DIRECT_ALIGN = 4096
MiB = 1 << 20


@dataclass(frozen=True)
class Workload:
    name: str
    size: int  # bytes per read
    align: int  # offsets are multiples of this
    sequential: bool = False


WORKLOADS = {
    w.name: w
    for w in (
        Workload("rand4k", 4096, 4096),
        Workload("rand2k", 2048, 2),
        Workload("rand128k", 128 << 10, 4096),
        Workload("seq1m", MiB, MiB, sequential=True),
    )
}


@dataclass
class Row:
    path: str
    workload: str
    readers: int
    cache: str
    iops: float
    mbps: float
    p50_us: float
    p99_us: float
    ratio_to_local: float | None = None


# ---- the reader processes ---------------------------------------------------------


@dataclass(frozen=True)
class Target:
    local_file: str
    fuse_file: str | None
    remote_path: str  # the file's path inside shufflefs
    config: str  # client config
    local_reads: bool = True  # native paths may read this host's chunk files directly
    netns: tuple[str, ...] = ()  # reader i runs on host netns[i % len] (`bench --remote`)


def offsets(w: Workload, file_size: int, seed: int, start: int) -> Iterator[int]:
    rng = random.Random(seed)
    if w.sequential:
        pos = start - start % w.align
        while True:
            if pos + w.size > file_size:
                pos = 0
            yield pos
            pos += w.size
    slots = (file_size - w.size) // w.align
    while True:
        yield rng.randrange(0, slots) * w.align


class Reader:
    """What one reader process holds open across rows."""

    def __init__(self, target: Target, file_size: int, batch: int) -> None:
        self.target = target
        self.file_size = file_size
        self.batch = batch
        self.client: Any = None
        self.remote: Any = None
        self.fds: dict[tuple[str, bool], int] = {}
        self.buf = mmap.mmap(-1, 2 * MiB)  # page aligned, as O_DIRECT wants

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        if self.remote is not None:
            self.remote.close()
        if self.client is not None:
            self.client.close()

    def run(
        self, path: str, w: Workload, seconds: float, cold: bool, seed: int, start: int
    ) -> tuple[int, int, list[int]]:
        """(reads done, bytes read, latency of each call in ns) over *seconds*."""
        gen = offsets(w, self.file_size, seed, start)
        deadline = time.perf_counter() + seconds
        if path in ("local", "fuse"):
            return self._posix(path, w, gen, deadline, cold)
        if self.client is None:
            from shufflefs.client import Client
            from shufflefs.client.fs import ClientOptions

            self.client = Client(
                self.target.config, ClientOptions(local_reads=self.target.local_reads)
            )
            self.remote = self.client.open(self.target.remote_path, "rb", buffering=0)
        lat: list[int] = []
        nbytes = ops = 0
        while time.perf_counter() < deadline:
            if path == "native":
                off = next(gen)
                t0 = time.perf_counter_ns()
                nbytes += len(self.remote.pread(off, w.size))
                ops += 1
            else:  # native-batch: `batch` reads per call
                ranges = [(next(gen), w.size) for _ in range(self.batch)]
                t0 = time.perf_counter_ns()
                nbytes += len(self.remote.pread_batch(ranges))
                ops += self.batch
            lat.append(time.perf_counter_ns() - t0)
        return ops, nbytes, lat

    def _posix(
        self, path: str, w: Workload, gen: Iterator[int], deadline: float, cold: bool
    ) -> tuple[int, int, list[int]]:
        name = self.target.local_file if path == "local" else self.target.fuse_file
        assert name is not None
        key = (name, cold)
        if key not in self.fds:
            self.fds[key] = os.open(name, os.O_RDONLY | (os.O_DIRECT if cold else 0))
        fd = self.fds[key]
        lat: list[int] = []
        nbytes = 0
        buf = memoryview(self.buf)
        while time.perf_counter() < deadline:
            off = next(gen)
            if cold:  # O_DIRECT wants aligned I/O: read the blocks covering the range
                first = off - off % DIRECT_ALIGN
                end = -(-(off + w.size) // DIRECT_ALIGN) * DIRECT_ALIGN
                off, view = first, [buf[: end - first]]
            else:
                view = [buf[: w.size]]
            t0 = time.perf_counter_ns()
            os.preadv(fd, view, off)
            lat.append(time.perf_counter_ns() - t0)
            nbytes += w.size
        return len(lat), nbytes, lat


def reader_main(conn: Connection, index: int, target: Target, file_size: int, batch: int) -> None:
    """One reader process: runs the rows it is sent and sends back latencies."""
    if target.netns:  # first, before the client starts a thread or opens a socket
        from shufflefs.cluster.netns import enter

        enter(target.netns[index % len(target.netns)])
    reader = Reader(target, file_size, batch)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            path, wname, seconds, cold, seed, start = msg
            try:
                conn.send(reader.run(path, WORKLOADS[wname], seconds, cold, seed, start))
            except Exception as exc:  # tell the parent rather than die silently
                conn.send(("error", f"{type(exc).__name__}: {exc}", []))
    finally:
        reader.close()


STOPS = {signal.SIGINT, signal.SIGTERM}


def _child(main: Callable[..., None], *args: Any) -> None:
    """A pool's child: the signals its parent held while starting it (the
    mask is inherited) taken again, then *main*."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    main(*args)


class ProcessPool:
    """N spawned processes, each running ``main(conn, index, *args)`` on its end of a
    pipe until it receives None; started once and reused for every row."""

    def __init__(self, n: int, main: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        # a Ctrl-C or SIGTERM while a child is being started is taken once
        # every child has what it starts from: a parent stopped mid-way left
        # the child a cut-off pipe, and its traceback on the run's stderr
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_child, args=(main, child, i, *args), daemon=True)
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class ReaderPool(ProcessPool):
    """N reader processes (`reader_main`)."""

    def __init__(self, n: int, target: Target, file_size: int, batch: int) -> None:
        super().__init__(n, reader_main, target, file_size, batch)

    def run(
        self, readers: int, path: str, w: Workload, seconds: float, cold: bool, file_size: int
    ) -> tuple[int, int, float, np.ndarray]:
        t0 = time.perf_counter()
        for i, conn in enumerate(self.conns[:readers]):
            conn.send((path, w.name, seconds, cold, 1000 * i + 7, i * file_size // readers))
        results = [conn.recv() for conn in self.conns[:readers]]
        wall = time.perf_counter() - t0
        for r in results:
            if r[0] == "error":
                raise RuntimeError(f"{path} {w.name}: a reader failed: {r[1]}")
        ops = sum(r[0] for r in results)
        nbytes = sum(r[1] for r in results)
        lat = np.concatenate([np.asarray(r[2], dtype=np.int64) for r in results])
        return ops, nbytes, wall, lat


# ---- setup --------------------------------------------------------------------------


def drop_caches() -> bool:
    """Drop this machine's page caches (the storage daemons' too); False
    when not root and they cannot be dropped."""
    if os.geteuid() != 0:
        return False
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return True


def read_whole(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass


def write_test_file(local: Path, fuse: Path | None, config: str, remote: str, size: int) -> None:
    """The same random bytes to the local copy and into shufflefs."""
    rng = np.random.default_rng(12345)
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "wb") as lf:
        for _ in range(size // (8 * MiB)):
            lf.write(rng.integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes())
    if fuse is not None:
        fuse.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, fuse)
    else:
        from shufflefs.client import Client

        with Client(config) as c:
            c.makedirs(os.path.dirname(remote) or "/", exist_ok=True)
            with open(local, "rb") as lf, c.open(remote, "wb") as rf:
                shutil.copyfileobj(lf, rf, 8 * MiB)


@contextlib.contextmanager
def embedded_cluster(workdir: Path, up_args: Sequence[str] = ()) -> Iterator[tuple[str, Path]]:
    """A cluster `shufflefs up` starts in *workdir* (with *up_args*), stopped after."""
    data, mnt = workdir / "cluster", workdir / "mnt"
    cmd = [sys.executable, "-m", "shufflefs.cluster.cli"]
    subprocess.run(
        [*cmd, "up", "--data-dir", str(data), "--mountpoint", str(mnt), *up_args],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield str(data / "client.toml"), mnt
    finally:
        subprocess.run([*cmd, "down", "--data-dir", str(data)], stdout=subprocess.DEVNULL)


# ---- the run ----------------------------------------------------------------------------


def run_rows(
    pool: ReaderPool,
    target: Target,
    file_size: int,
    paths: list[str],
    workloads: list[str],
    reader_counts: list[int],
    caches: list[str],
    seconds: float,
    progress: bool,
) -> list[Row]:
    rows: list[Row] = []
    for cache in caches:
        cold = cache == "cold"
        if not cold:
            read_whole(target.local_file)
            if target.fuse_file:
                read_whole(target.fuse_file)
        for readers in reader_counts:
            for wname in workloads:
                w = WORKLOADS[wname]
                for path in paths:
                    if path == "fuse" and not target.fuse_file:
                        continue
                    if cold:
                        drop_caches()
                    ops, nbytes, wall, lat = pool.run(readers, path, w, seconds, cold, file_size)
                    row = Row(
                        path=path,
                        workload=wname,
                        readers=readers,
                        cache=cache,
                        iops=ops / wall,
                        mbps=nbytes / wall / 1e6,
                        p50_us=float(np.percentile(lat, 50)) / 1e3 if len(lat) else 0.0,
                        p99_us=float(np.percentile(lat, 99)) / 1e3 if len(lat) else 0.0,
                    )
                    rows.append(row)
                    if progress:
                        print(
                            f"  {cache:<4} {readers:>2}r {wname:<8} {path:<12} "
                            f"{row.iops:>10,.0f} IOPS",
                            file=sys.stderr,
                        )
    local = {(r.workload, r.readers, r.cache): r.iops for r in rows if r.path == "local"}
    for r in rows:
        base = local.get((r.workload, r.readers, r.cache))
        r.ratio_to_local = r.iops / base if base else None
    return rows


def render(rows: list[Row], out: Any = sys.stdout) -> None:
    print(
        f"{'cache':<5} {'rd':>3} {'workload':<9} {'path':<13} {'IOPS':>10} {'MB/s':>9} "
        f"{'p50 us':>9} {'p99 us':>9} {'x local':>8}",
        file=out,
    )
    for r in rows:
        ratio = f"{r.ratio_to_local:.2f}" if r.ratio_to_local is not None else "-"
        print(
            f"{r.cache:<5} {r.readers:>3} {r.workload:<9} {r.path:<13} {r.iops:>10,.0f} "
            f"{r.mbps:>9,.1f} {r.p50_us:>9,.1f} {r.p99_us:>9,.1f} {ratio:>8}",
            file=out,
        )


def caches_of(args: argparse.Namespace) -> list[str]:
    """Warm, and cold where the page caches can be dropped (root) unless --no-cold."""
    return ["warm"] if os.geteuid() != 0 or args.no_cold else ["warm", "cold"]


@contextlib.contextmanager
def test_file(
    args: argparse.Namespace,
    config: str,
    mountpoint: Path | None,
    workdir: Path,
    file_size: int,
    netns: tuple[str, ...] = (),
) -> Iterator[Target]:
    """The test file, in shufflefs and as a local copy in *workdir*, as the
    readers' `Target`; removed from shufflefs after."""
    remote = f"/.bench/io-{os.getpid()}.bin"
    local_file = workdir / "local.bin"
    fuse_file = mountpoint / remote.lstrip("/") if mountpoint else None
    if not args.json:
        print(
            f"writing a {file_size // MiB} MiB test file (local copy in {workdir})",
            file=sys.stderr,
        )
    write_test_file(local_file, fuse_file, config, remote, file_size)
    try:
        yield Target(
            str(local_file),
            str(fuse_file) if fuse_file else None,
            remote,
            config,
            local_reads=not args.no_local_reads,
            netns=netns,
        )
    finally:
        if fuse_file is not None:
            with contextlib.suppress(OSError):
                fuse_file.unlink()
        else:
            from shufflefs.client import Client

            with contextlib.suppress(OSError), Client(config) as c:
                c.unlink(remote)


def measure(args: argparse.Namespace, target: Target, file_size: int) -> list[Row]:
    """Every row the options ask for, on *target*."""
    reader_counts = sorted({1, args.readers})
    pool = ReaderPool(max(reader_counts), target, file_size, args.batch)
    try:
        return run_rows(
            pool,
            target,
            file_size,
            args.paths.split(",") if args.paths else list(PATHS),
            args.workloads.split(",") if args.workloads else list(WORKLOADS),
            reader_counts,
            caches_of(args),
            seconds_of(args),
            progress=not args.json and sys.stderr.isatty(),
        )
    finally:
        pool.close()


def seconds_of(args: argparse.Namespace) -> float:
    return float(args.seconds or (0.4 if args.quick else 5.0))


def check_workloads(args: argparse.Namespace) -> None:
    for name in args.workloads.split(",") if args.workloads else []:
        if name not in WORKLOADS:
            raise SystemExit(f"shufflefs bench: unknown workload {name!r}")


def cli_io(args: argparse.Namespace) -> int:
    file_size = (args.size_mb or (256 if args.quick else 1024)) * MiB
    check_workloads(args)
    with contextlib.ExitStack() as stack:
        workdir = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="shufflefs-bench-", dir=args.local_dir)
            )
        )
        if args.embedded:
            config, mnt = stack.enter_context(embedded_cluster(workdir))
            mountpoint: Path | None = mnt
        else:
            from shufflefs.cluster.config import find_client_config

            config_path = find_client_config(args.config).absolute()
            config = str(config_path)
            if args.mountpoint:
                mountpoint = Path(args.mountpoint).absolute()
            else:  # a cluster `shufflefs up` started records where it mounted
                mountpoint = LocalCluster(config_path.parent).recorded_mountpoint()
        target = stack.enter_context(test_file(args, config, mountpoint, workdir, file_size))
        rows = measure(args, target, file_size)
    caches = caches_of(args)
    settings = {
        "file_mb": file_size // MiB,
        "seconds_per_row": seconds_of(args),
        "batch": args.batch,
        "cold": "cold" in caches,
        "embedded": bool(args.embedded),
        "native_local_reads": not args.no_local_reads,
    }
    if args.json:
        print(json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        render(rows)
        if "cold" not in caches and not args.no_cold:
            print("(cold rows need root to drop the page caches)")
    return 0
