"""``shufflefs bench files``: one-file-per-sample datasets, as ordinary
dataloaders read them, side by side with a local directory.

One ImageFolder-shaped set (``--files`` N files of ``--size`` S bytes in
``--dirs`` C class directories; 20,000 x 110 KiB in 100 by default,
2,000 x 110 KiB in 20 with ``--quick``) is created in a local directory and
in the mount, then measured through every way in there is:

    local          a directory on the local disk: the limit
    fuse           the mount (``--mount``, else the cluster's own mount)
    fuse-writeback creates only: a ``shufflefs mount -o writeback`` (closes
                   finish behind: fuse/writeback.py), timed until its closes
                   are all done, into a copy of the set removed after
    fuse-ro        the same files through a ``shufflefs mount -o ro``
    fuse-immutable the same through a ``shufflefs mount -o cache=immutable``
    fuse-prefetch  the cache=immutable mount (``--prefetch-mount``), each reader
                   hinting its next files (client/data/hinted_reads.py)
    native         `FileDataset` of `shufflefs.client.data` over the same files;
                   creates: ``shufflefs import`` of the local set into a copy
                   (client/ingest.py: one process, 256 files in flight),
                   removed after

Operations: ``create`` (create+write+close per file; the first part of the
set is written by 1 process, the rest by ``--procs`` P, so both rates come
from writing the set once), ``stat`` and ``read`` (open+read+close) of every
file in one shuffled order, ``scan`` (every directory listed, entries/s);
each with 1 and P processes, ``cold`` (page, dentry and inode caches dropped
right before, as root: ``echo 3 > /proc/sys/vm/drop_caches``; the storage
daemons run on this machine, so theirs go too; their own caches of chunk
records and open chunk files stay, as on a cluster that keeps running, which
the JSON's notes say) and ``warm`` (the same
operation run once just before). Create rows are labelled ``warm`` (nothing
is dropped). Every row has ``ratio_to_local``: its rate over the local row of
the same op, processes and cache, in this run. Then a real
``torch.utils.data.DataLoader(num_workers=4)`` over an ImageFolder-style
``Dataset`` reads the files in a shuffled order (``loader`` rows).

Which cluster: ``--embedded`` starts one (``shufflefs up`` in a temp dir,
``--replicas``), stopped after. ``--mount DIR`` measures any mounted
filesystem (also another one, e.g. MooseFS: then there is no native or
fuse-ro and fuse-immutable rows unless ``--config`` names the shufflefs
cluster behind DIR);
``--ro-mount`` / ``--prefetch-mount`` name mounts for those rows. Without
any, the client config's cluster and the mount `shufflefs up` made are
used, and a cluster is started when there is no config. ``--remote`` starts
a cluster whose storage daemons are on hosts of their own and runs every
mount and worker on a reader host (client/bench_files_remote.py): the
figures of a training node that is not a storage host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shufflefs.client import bench_files_remote as remote
from shufflefs.client import bench_files_work as work
from shufflefs.client.bench_files_work import FileSet, WorkerPool, split
from shufflefs.client.data.hinted_reads import prefetch_available
from shufflefs.client.iobench import drop_caches, embedded_cluster
from shufflefs.cluster.config import find_client_config
from shufflefs.cluster.launcher import LocalCluster
from shufflefs.cluster.preflight import parse_size
from shufflefs.fuse.writeback import closes_behind

PATHS = ("local", "fuse", "fuse-ro", "fuse-immutable", "fuse-prefetch", "native")
CREATE_PATHS = ("local", "fuse", "fuse-writeback")  # (the rest read what these wrote)
ALL_PATHS = tuple(dict.fromkeys((*CREATE_PATHS, *PATHS)))  # in the order reported
OPS = ("create", "stat", "scan", "read")
READ_OPS = ("stat", "scan", "read")
# the worker operation behind each (path, op); a missing pair is not measured
OPERATION = {
    **{(p, op): op for p in ("local", "fuse", "fuse-ro", "fuse-immutable") for op in READ_OPS},
    ("fuse-prefetch", "read"): "prefetch-read",
    ("native", "read"): "native-read",
}
LOADER_PATHS = ("local", "fuse", "fuse-ro", "fuse-immutable")
CLI = [sys.executable, "-m", "shufflefs.cluster.cli"]


@dataclass
class Row:
    path: str
    procs: int
    cache: str
    op: str
    per_s: float
    count: int
    seconds: float
    ratio_to_local: float | None = None


@dataclass
class LoaderRow:
    path: str
    cache: str
    workers: int
    per_s: float
    ratio_to_local: float | None = None


@dataclass(frozen=True)
class Settings:
    """What one run measures, from the command line."""

    files: FileSet
    procs: int
    reads: int  # files read (and stat'ed) per row: a shuffled prefix of the set
    ops: tuple[str, ...]
    caches: tuple[str, ...]
    loader_workers: int  # 0: no DataLoader rows
    seed: int
    unbuffered: bool = False  # the read rows open with buffering=0 (no isatty ioctl)

    @property
    def proc_counts(self) -> list[int]:
        return sorted({1, self.procs})


def settings_from_args(args: argparse.Namespace, root: bool | None = None) -> Settings:
    """The run's settings; *root* (default: are we?) decides the cold rows."""
    quick = bool(args.quick)
    files = args.files or (2000 if quick else 20000)
    dirs = min(args.dirs or (20 if quick else 100), files)
    size = parse_size(args.size) if args.size else 110 << 10
    if size < work.HEADER:
        raise ValueError(f"--size must be at least {work.HEADER} bytes (the file's header)")
    ops = tuple(args.ops.split(",")) if args.ops else OPS
    if root is None:
        root = os.geteuid() == 0
    caches = ("cold", "warm") if root and not args.no_cold else ("warm",)
    return Settings(
        files=FileSet(files, size, dirs),
        procs=args.procs,
        reads=min(args.reads or files, files),
        ops=ops,
        caches=caches,
        loader_workers=0 if args.no_loader else args.loader_workers,
        seed=args.seed,
        unbuffered=bool(args.unbuffered),
    )


# ---- where each path's files are ---------------------------------------------------------


COLD_NOTE = (
    "cold: page, dentry and inode caches dropped on every host; the storage daemons keep "
    "their caches of chunk records and open chunk files (a running cluster's; a daemon "
    "restarted since holds neither)"
)


@dataclass
class Targets:
    roots: dict[str, str] = field(default_factory=dict)  # path -> its root (native: url, config)
    notes: list[str] = field(default_factory=list)
    config: str | None = None  # the shufflefs cluster behind the fuse row, if known
    writeback_metrics: str = ""  # the fuse-writeback mount's Prometheus URL
    import_spec: str = ""  # the native create row's import (`work.do_import`), if measured
    remote: remote.RemoteRun | None = None  # --remote: the cluster and its reader host

    @property
    def netns(self) -> str | None:
        """The host every worker runs on (None: this one)."""
        return self.remote.netns if self.remote is not None else None

    def option_mount(
        self, mountpoint: Path, options: str
    ) -> contextlib.AbstractContextManager[Path]:
        """A further ``mount -o OPTIONS`` of the cluster, where the readers are."""
        if self.remote is not None:
            return remote.option_mount(self.remote, mountpoint, options)
        assert self.config is not None
        return option_mount(self.config, mountpoint, options)


def ro_mount_supported() -> bool:
    """Whether ``shufflefs mount -o ro`` exists in this tree."""
    from shufflefs.fuse.mount import parse_options
    from shufflefs.rpc.errors import FsError

    try:
        parse_options(["ro"])
    except FsError:
        return False
    return True


@contextlib.contextmanager
def option_mount(config: str, mountpoint: Path, options: str = "ro") -> Iterator[Path]:
    """A ``shufflefs mount -o OPTIONS`` of *config*'s cluster, unmounted after."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:  # (a stop while mounting unmounts too)
        subprocess.run(
            [*CLI, "mount", "-o", options, "--config", config, str(mountpoint)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        yield mountpoint
    finally:
        subprocess.run(
            [*CLI, "umount", str(mountpoint)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )


def cluster_and_mount(
    args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack
) -> tuple[str | None, Path, bool]:
    """(client config or None, the mount for the fuse rows, whether we started it)."""
    if args.mount:
        return (
            (str(Path(args.config).absolute()) if args.config else None),
            Path(args.mount).absolute(),
            False,
        )
    config_path = find_client_config(args.config)
    if not args.embedded and config_path.exists():
        mnt = LocalCluster(config_path.absolute().parent).recorded_mountpoint()
        if mnt is None:
            raise ValueError(f"the cluster of {config_path} is not mounted: pass --mount")
        return str(config_path.absolute()), mnt, False
    extra = ["--replicas", str(args.replicas)] if args.replicas else []
    config, mnt = stack.enter_context(embedded_cluster(workdir, extra))
    return config, mnt, True


def targets(
    args: argparse.Namespace, s: Settings, workdir: Path, stack: contextlib.ExitStack
) -> Targets:
    t = Targets()
    local = Path(args.local_dir).absolute() if args.local_dir else workdir
    subdir = f"bench-files-{os.getpid()}"
    t.roots["local"] = str(local / subdir)
    stack.callback(shutil.rmtree, t.roots["local"], True)
    if getattr(args, "remote", False):
        t.remote, t.config, mnt = remote.start(args, workdir, stack)
        t.notes.append(t.remote.note())
        started = True
    else:
        t.config, mnt, started = cluster_and_mount(args, workdir, stack)
    t.roots["fuse"] = str(mnt / subdir)
    if not started and not args.keep:
        stack.callback(shutil.rmtree, t.roots["fuse"], True)
    if args.ro_mount:
        t.roots["fuse-ro"] = str(Path(args.ro_mount).absolute() / subdir)
    elif t.config is None:
        t.notes.append("fuse-ro: left out: no --config for the cluster behind --mount")
    elif not ro_mount_supported():
        t.notes.append("fuse-ro: left out: `shufflefs mount -o ro` is not in this tree")
    else:
        ro = stack.enter_context(t.option_mount(workdir / "ro-mnt", "ro"))
        t.roots["fuse-ro"] = str(ro / subdir)
    if t.config is None:
        t.notes.append("fuse-writeback: left out: no --config for the cluster behind --mount")
    elif "create" in s.ops:
        address = remote.metrics_address(t.remote)
        options = f"writeback,metrics={address}"
        wb = stack.enter_context(t.option_mount(workdir / "writeback-mnt", options))
        t.roots["fuse-writeback"] = str(wb / f"{subdir}-writeback")
        t.writeback_metrics = f"http://{address}/metrics"
        stack.callback(shutil.rmtree, t.roots["fuse-writeback"], True)  # (before the unmount)
    if t.config is None:
        t.notes.append("fuse-immutable: left out: no --config for the cluster behind --mount")
    else:
        options = "cache=immutable"
        immutable = stack.enter_context(t.option_mount(workdir / "immutable-mnt", options))
        t.roots["fuse-immutable"] = str(immutable / subdir)
    # prefetch along the shuffle is for training data: the dataset mode's
    # mount, unless told otherwise
    dataset_mount = Path(t.roots.get("fuse-immutable", mnt / subdir)).parent
    prefetch_root = Path(args.prefetch_mount or dataset_mount).absolute()
    if prefetch_available(str(prefetch_root)):
        t.roots["fuse-prefetch"] = str(prefetch_root / subdir)
    else:
        t.notes.append(f"fuse-prefetch: left out: {prefetch_root} takes no prefetch hints")
    if t.config is None:
        t.notes.append("native: left out: no --config for the cluster behind --mount")
    else:
        t.roots["native"] = f"shufflefs:///{subdir}\n{t.config}"
        if "create" in s.ops:  # into a copy of the set, removed after (through the mount)
            t.import_spec = f"{t.roots['local']}\n/{subdir}-import\n{t.config}"
            stack.callback(shutil.rmtree, str(mnt / f"{subdir}-import"), True)
    return t


# ---- the run ----------------------------------------------------------------------------------


def writeback_settled(url: str, timeout: float = 600.0) -> None:
    """Wait until the writeback mount with metrics at *url* has finished
    every close it started."""
    deadline = time.monotonic() + timeout
    while closes_behind(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the writeback mount's closes not done after {timeout:g}s")
        time.sleep(0.02)


def with_ratios(rows: list[Row]) -> list[Row]:
    local = {(r.op, r.procs, r.cache): r.per_s for r in rows if r.path == "local"}
    for r in rows:
        base = local.get((r.op, r.procs, r.cache))
        r.ratio_to_local = r.per_s / base if base else None
    return rows


def create_rows(pool: WorkerPool, s: Settings, t: Targets, progress: bool) -> list[Row]:
    """Write the set once per writable path: part k by proc_counts[k] processes."""
    rows: list[Row] = []
    names = [s.files.name(i) for i in range(s.files.files)]
    parts = split(names, len(s.proc_counts))
    for path in CREATE_PATHS:
        root = t.roots.get(path)
        if root is None:
            continue
        for d in s.files.directories():
            os.makedirs(os.path.join(root, d), exist_ok=True)
        for procs, part in zip(s.proc_counts, parts, strict=True):
            tasks = [("create", root, chunk, s.files.size) for chunk in split(part, procs)]
            started = time.monotonic()
            count, seconds = pool.run(tasks)
            if path == "fuse-writeback":  # until the closes behind are done too
                writeback_settled(t.writeback_metrics)
                seconds = time.monotonic() - started
            rows.append(Row(path, procs, "warm", "create", count / seconds, count, seconds))
            report(rows[-1], progress)
    if t.import_spec:  # the native row: `shufflefs import` of the local set, one process
        count, seconds = pool.run([("import", t.import_spec, names, s.files.size)])
        rows.append(Row("native", 1, "warm", "create", count / seconds, count, seconds))
        report(rows[-1], progress)
    return rows


def read_rows(pool: WorkerPool, s: Settings, t: Targets, progress: bool) -> list[Row]:
    rows: list[Row] = []
    order = [s.files.name(i) for i in s.files.shuffled(s.seed, s.reads)]
    dirs = s.files.directories()
    for cache in s.caches:
        for op in READ_OPS:
            if op not in s.ops:
                continue
            items = dirs if op == "scan" else order
            for procs in s.proc_counts:
                for path in PATHS:
                    operation = OPERATION.get((path, op))
                    if operation is None or path not in t.roots:
                        continue
                    if s.unbuffered and operation in ("read", "prefetch-read"):
                        operation += "-unbuffered"
                    tasks = [
                        (operation, t.roots[path], chunk, s.files.size)
                        for chunk in split(items, procs)
                    ]
                    if operation == "native-read":
                        # every worker's dataset made before any is timed: a
                        # row's span runs from the first start to the last end
                        pool.run([("native-setup", *task[1:]) for task in tasks])
                    if cache == "cold":
                        drop_caches()
                    else:
                        pool.run(tasks)  # the warm-up: the same operation once
                    count, seconds = pool.run(tasks)
                    rows.append(Row(path, procs, cache, op, count / seconds, count, seconds))
                    report(rows[-1], progress)
    return rows


def loader_rows(s: Settings, t: Targets, progress: bool) -> list[LoaderRow]:
    rows: list[LoaderRow] = []
    if not s.loader_workers:
        return rows
    order = [s.files.name(i) for i in s.files.shuffled(s.seed, s.reads)]
    for cache in s.caches:
        for path in LOADER_PATHS:
            if path not in t.roots:
                continue
            root = t.roots[path]
            if cache == "cold":
                drop_caches()
            else:
                work.loader_rate(root, order, s.files.size, s.loader_workers, s.seed)
            rate = work.loader_rate(root, order, s.files.size, s.loader_workers, s.seed + 1)
            rows.append(LoaderRow(path, cache, s.loader_workers, rate))
            if progress:
                print(f"  loader {cache:<4} {path:<13} {rate:>10,.0f}/s", file=sys.stderr)
    local = {r.cache: r.per_s for r in rows if r.path == "local"}
    for r in rows:
        base = local.get(r.cache)
        r.ratio_to_local = r.per_s / base if base else None
    return rows


def report(row: Row, progress: bool) -> None:
    if progress:
        print(
            f"  {row.op:<6} {row.cache:<4} {row.procs:>2}p {row.path:<13} {row.per_s:>10,.0f}/s",
            file=sys.stderr,
        )


def render(rows: list[Row], loader: list[LoaderRow], notes: list[str]) -> None:
    print(f"{'op':<7} {'cache':<5} {'procs':>5} {'path':<14} {'per s':>11} {'x local':>8}")
    for r in rows:
        ratio = f"{r.ratio_to_local:.2f}" if r.ratio_to_local is not None else "-"
        print(f"{r.op:<7} {r.cache:<5} {r.procs:>5} {r.path:<14} {r.per_s:>11,.0f} {ratio:>8}")
    for lr in loader:
        ratio = f"{lr.ratio_to_local:.2f}" if lr.ratio_to_local is not None else "-"
        print(
            f"{'loader':<7} {lr.cache:<5} {lr.workers:>4}w {lr.path:<14} "
            f"{lr.per_s:>11,.0f} {ratio:>8}"
        )
    for note in notes:
        print(f"({note})")


def cli_files(args: argparse.Namespace) -> int:
    try:
        s = settings_from_args(args)
    except ValueError as exc:
        print(f"shufflefs bench files: {exc}", file=sys.stderr)
        return 2
    progress = not args.json and sys.stderr.isatty()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shufflefs-files-")))
        try:
            t = targets(args, s, workdir, stack)
        except ValueError as exc:
            print(f"shufflefs bench files: {exc}", file=sys.stderr)
            return 2
        if "cold" not in s.caches:
            t.notes.append("cold rows need root (to drop the page caches)")
        elif t.config is not None:
            t.notes.append(COLD_NOTE)
        pool = WorkerPool(s.procs, t.netns)
        stack.callback(pool.close)
        rows = create_rows(pool, s, t, progress)
        rows += read_rows(pool, s, t, progress)
        loader = loader_rows(s, t, progress)
    with_ratios(rows)
    if args.json:
        out = {
            "settings": {
                **asdict(s.files),
                "procs": s.procs,
                "reads": s.reads,
                "caches": list(s.caches),
                "loader_workers": s.loader_workers,
                "seed": s.seed,
                "unbuffered": s.unbuffered,
                "mount": t.roots["fuse"],
                "paths": sorted(t.roots, key=ALL_PATHS.index),
                "remote": t.remote.settings() if t.remote is not None else None,
            },
            "rows": [asdict(r) for r in rows],
            "loader": [asdict(r) for r in loader],
            "notes": t.notes,
        }
        print(json.dumps(out, indent=2))
    else:
        render(rows, loader, t.notes)
    return 0
