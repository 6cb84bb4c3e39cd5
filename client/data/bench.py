"""``shufflefs bench loader``: shuffled token windows per second, four ways.

One token dataset (``--dataset-size``, default 2 GiB of uint16 in 8 files),
one shuffled order (seed 0, epoch 0), read as training reads it: batches of
``batch_size`` random windows of ``seq_len + 1`` tokens. The batch size is
swept (8 ... 4096 by default) and each row reads the same windows through

* ``local``     a copy on the local disk, plain ``pread``s: the limit;
* ``local+ra``  the same copy with the dataset's thread-pool readahead (cold, a
  local disk needs reads in flight too: plain reads wait for it one by one);
* ``fuse``      the shufflefs FUSE mount, plain ``pread``s (what any loader gets);
* ``fuse+ra``   the FUSE mount with the dataset's thread-pool readahead;
* ``native``    the native client, one request per storage node per batch;
* ``native+ra`` the same with ``--readahead`` batches in flight along the shuffle.

Every row is measured twice: the token files as one dataset, and (``... mix``)
split into a 3-component `Mixture` weighted 0.5 / 0.3 / 0.2, the price of the
mixture's order and its per-component reads next to the single dataset's.

A *cold* pass drops the page caches before every measurement (``echo 3 >
/proc/sys/vm/drop_caches``, as root; the storage daemons run on this machine,
so their caches go too) and reads from the start of the order. The *warm*
pass then replays exactly the windows the cold pass read (again and again
until the time is up), so every byte is in some page cache: the second epoch
of a dataset that fits in memory. Reported per row: tokens/s (``seq_len``
training tokens per sample), samples/s, the p50 and p99 latency of one batch
(from asking for it to having it) and how many batches were measured. Every
row's first batch is compared with the local copy's: a wrong byte fails the
run.

With ``--embedded`` a cluster is started with ``shufflefs up`` in a temp dir
and stopped at the end; otherwise ``--config`` (and ``--mountpoint`` for the
FUSE rows) name a running one. The dataset is written once and reused while
its files are there with the right size.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shufflefs.client.data.tokens import TokenWindows
from shufflefs.client.data.urls import client_for
from shufflefs.client.iobench import drop_caches
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.lifecycle import down, up
from shufflefs.cluster.preflight import parse_size
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:  # the mixture imports torch when it is there (seconds): on first use
    from shufflefs.client.data.datasets import Mixture

log = logging.getLogger("shufflefs.bench")

CONFIGS = ("local", "local+ra", "fuse", "fuse+ra", "native", "native+ra")
SHAPES = ("single", "mixture")  # every config reads one dataset, and a 3-component mixture
MIX = "mix"
MIX_WEIGHTS = [0.5, 0.3, 0.2]
VOCAB = 50257  # GPT-2's: token values look like real ones
GEN_PIECE = 32 << 20  # tokens generated at a time while writing the dataset
MIN_BATCHES = 3


@dataclass
class Result:
    phase: str  # cold | warm
    config: str
    batch_size: int
    batches: int
    seconds: float
    tokens_per_s: float
    samples_per_s: float
    p50_ms: float
    p99_ms: float


@dataclass
class Dataset:
    local: list[str]
    fuse: list[str] | None
    native: list[str]
    tokens: int
    dtype: str

    def paths(self, config: str) -> list[str]:
        if config.startswith("local"):
            return self.local
        if config.startswith("fuse"):
            assert self.fuse is not None
            return self.fuse
        return self.native


# ---- the cluster and the dataset ------------------------------------------------


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[tuple[Path, Path | None]]:
    """(client config, mountpoint or None) of the cluster to measure."""
    if not args.embedded:
        config = Path(args.config or os.environ.get("SHUFFLEFS_CONFIG") or ".shufflefs/client.toml")
        load_client_config(config)  # a clear error now if it is not there
        mount = Path(args.mountpoint) if args.mountpoint else None
        if mount is not None and not os.path.ismount(mount):
            raise FsError(errno.ENOENT, f"{mount} is not a mountpoint")
        yield config.absolute(), mount
        return
    base = Path(tempfile.mkdtemp(prefix="shufflefs-bench-"))
    data, mount = base / "data", base / "mnt"
    try:
        up(data, mount, out=sys.stderr)  # (it returns once new files can be made)
        yield data / "client.toml", mount
    finally:
        with contextlib.suppress(FsError):
            down(data, out=sys.stderr)
        shutil.rmtree(base, ignore_errors=True)


def file_tokens(index: int, count: int, dtype: np.dtype[Any]) -> Iterator[np.ndarray[Any, Any]]:
    """The content of dataset file *index*, deterministically, in pieces."""
    rng = np.random.default_rng([20240601, index])
    for lo in range(0, count, GEN_PIECE):
        yield rng.integers(0, VOCAB, size=min(GEN_PIECE, count - lo), dtype=dtype)


def prepare_dataset(
    args: argparse.Namespace, config: Path, mount: Path | None, local_dir: Path
) -> Dataset:
    dtype = np.dtype(args.dtype)
    total = parse_size(args.dataset_size)
    per_file = total // args.files // dtype.itemsize
    if per_file <= args.seq_len + 1:
        raise FsError(errno.EINVAL, "--dataset-size too small for that many files")
    client = client_for(config)
    mgmtd = load_client_config(config)[0].mgmtd
    remote = args.remote_dir.rstrip("/") or "/bench-loader"
    client.makedirs(remote, exist_ok=True)
    local_dir.mkdir(parents=True, exist_ok=True)
    names = [f"tokens-{i:03d}.bin" for i in range(args.files)]
    nbytes = per_file * dtype.itemsize
    for i, name in enumerate(names):
        lp, rp = local_dir / name, f"{remote}/{name}"
        have_local = lp.exists() and lp.stat().st_size == nbytes
        have_remote = client.exists(rp) and client.stat(rp).st_size == nbytes
        if have_local and have_remote:
            continue
        t0 = time.perf_counter()
        with open(lp, "wb") as lf, client.open(rp, "wb") as rf:
            for piece in file_tokens(i, per_file, dtype):
                data = piece.tobytes()
                lf.write(data)
                rf.write(data)
        print(
            f"wrote {name}: {nbytes / 2**20:.0f} MiB locally and to the cluster "
            f"in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return Dataset(
        local=[str(local_dir / n) for n in names],
        fuse=[str(mount / remote.lstrip("/") / n) for n in names] if mount else None,
        native=[f"shufflefs://{mgmtd}{remote}/{n}" for n in names],
        tokens=per_file * args.files,
        dtype=dtype.name,
    )


# ---- measuring ----------------------------------------------------------------------


def measure(
    ds: TokenWindows | Mixture, seconds: float, max_batches: int | None, close: bool = True
) -> tuple[list[float], float, str]:
    """Read batches from the start of the order for *seconds* (at least
    MIN_BATCHES, at most *max_batches*): per-batch latencies, the total
    time, and a digest of the first batch. Without *close* the dataset's
    files stay open for the next call, as a training job keeps them open
    from one step to the next (the warm replays are one long epoch, not
    many short jobs each paying its opens)."""
    ds.load_state_dict(ds.state_dict(consumed=0))
    latencies: list[float] = []
    digest = ""
    t0 = time.perf_counter()
    last = t0
    it = ds.iter_batches()
    try:
        for batch in it:
            now = time.perf_counter()
            latencies.append(now - last)
            if not digest:
                digest = hashlib.blake2b(
                    np.ascontiguousarray(batch).tobytes(), digest_size=8
                ).hexdigest()
            done = len(latencies)
            if max_batches is not None and done >= max_batches:
                break
            if now - t0 >= seconds and done >= MIN_BATCHES:
                break
            last = time.perf_counter()
    finally:
        it.close()
    total = time.perf_counter() - t0
    if close:
        ds.close()  # waits for reads still in flight, so they do not overlap the next run
    return latencies, total, digest


def summarize(
    phase: str, config: str, b: int, seq_len: int, lat: list[float], total: float
) -> Result:
    arr = np.asarray(lat) * 1000
    samples = len(lat) * b
    return Result(
        phase,
        config,
        b,
        len(lat),
        total,
        samples * seq_len / total,
        samples / total,
        float(np.percentile(arr, 50)),
        float(np.percentile(arr, 99)),
    )


def loader_dataset(
    args: argparse.Namespace, data: Dataset, config: str, batch: int, shape: str
) -> TokenWindows | Mixture:
    """The dataset one row reads: the token files as one dataset, or (shape
    "mixture") split into three components mixed 0.5 / 0.3 / 0.2, the same
    windows read through the mixture's order and its per-component reads."""
    readahead = args.readahead if config.endswith("+ra") else 0
    common: dict[str, Any] = dict(
        seq_len=args.seq_len, dtype=data.dtype, config=args.config_path, readahead=readahead
    )
    paths = data.paths(config)
    if shape == "single":
        return TokenWindows(paths, seed=args.seed, batch_size=batch, **common)
    if len(paths) >= 3:
        half, fifth = max(1, len(paths) // 2), max(1, len(paths) // 5)
        groups = [paths[:half], paths[half : len(paths) - fifth], paths[len(paths) - fifth :]]
    else:
        groups = [paths, paths, paths]
    parts = [TokenWindows(g, **common) for g in groups]
    from shufflefs.client.data.datasets import Mixture

    return Mixture(
        parts, weights=MIX_WEIGHTS, seed=args.seed, batch_size=batch, readahead=readahead
    )


def run(args: argparse.Namespace, data: Dataset) -> tuple[list[Result], list[str]]:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            raise FsError(errno.EINVAL, f"unknown config {c!r} (choose from {', '.join(CONFIGS)})")
    if data.fuse is None:
        dropped = [c for c in configs if c.startswith("fuse")]
        if dropped:
            print(f"no --mountpoint: skipping {', '.join(dropped)}", file=sys.stderr)
        configs = [c for c in configs if not c.startswith("fuse")]
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    notes: list[str] = []
    cold = not args.no_cold
    if cold and os.geteuid() != 0:
        notes.append("not root: caches cannot be dropped, so there is no cold pass")
        cold = False
    results: list[Result] = []
    # (batch size, shape) -> (row, first batch digest)
    reference: dict[tuple[int, str], tuple[str, str]] = {}
    for b in sizes:
        for config, shape in [(c, shape) for c in configs for shape in SHAPES]:
            ds = loader_dataset(args, data, config, b, shape)
            label = config if shape == "single" else f"{config} {MIX}"
            cold_batches: int | None = None
            digests = []
            if cold:
                drop_caches()
                lat, total, digest = measure(ds, args.seconds, None)
                results.append(summarize("cold", label, b, args.seq_len, lat, total))
                cold_batches = len(lat)
                digests.append(digest)
                log_row(results[-1])
            if not args.no_warm:
                if cold_batches is None:  # warm the caches with one pass first
                    cold_batches = len(measure(ds, args.seconds, None)[0])
                lat_all: list[float] = []
                total = 0.0
                while total < args.seconds or not lat_all:
                    lat, t, digest = measure(ds, args.seconds, cold_batches, close=False)
                    lat_all += lat
                    total += t
                    digests.append(digest)
                ds.close()
                results.append(summarize("warm", label, b, args.seq_len, lat_all, total))
                log_row(results[-1])
            for d in digests:
                first, ref = reference.setdefault((b, shape), (label, d))
                if d != ref:
                    raise FsError(
                        errno.EIO, f"{label} read other bytes than {first} at batch size {b}"
                    )
    return results, notes


def log_row(r: Result) -> None:
    print(
        f"  {r.phase:4} {r.config:9} batch {r.batch_size:5}: {r.tokens_per_s / 1e6:8.2f} M tokens/s"
        f"  p99 {r.p99_ms:8.1f} ms  ({r.batches} batches)",
        file=sys.stderr,
    )


# ---- output ------------------------------------------------------------------------------


def human(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def table(results: list[Result], phase: str) -> str:
    rows = [r for r in results if r.phase == phase]
    if not rows:
        return ""
    local = {
        (r.batch_size, r.config.endswith(MIX)): r.tokens_per_s
        for r in rows
        if r.config in ("local", f"local {MIX}")
    }
    head = ("batch", "config", "tokens/s", "samples/s", "p50 ms", "p99 ms", "batches", "vs local")
    lines = [head]
    for r in rows:
        ref = (r.batch_size, r.config.endswith(MIX))
        ratio = f"{r.tokens_per_s / local[ref]:.2f}x" if ref in local else "-"
        lines.append(
            (
                str(r.batch_size),
                r.config,
                human(r.tokens_per_s),
                human(r.samples_per_s),
                f"{r.p50_ms:.1f}",
                f"{r.p99_ms:.1f}",
                str(r.batches),
                ratio,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for line in lines:
        cells = [
            c.ljust(w) if i == 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells))
    return "\n".join(out)


def plot(results: list[Result], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in ("cold", "warm") if any(r.phase == p for r in results)]
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.8), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=True):
        for config in dict.fromkeys(r.config for r in results):
            rows = sorted(
                (r for r in results if r.phase == phase and r.config == config),
                key=lambda r: r.batch_size,
            )
            if rows:
                ax.plot(
                    [r.batch_size for r in rows],
                    [r.tokens_per_s for r in rows],
                    marker="o",
                    label=config,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (windows)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{phase} page cache")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cli_loader(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.seq_len < 1 or args.files < 1 or args.readahead < 1 or args.seconds <= 0:
        print(
            "shufflefs bench loader: bad --seq-len/--files/--readahead/--seconds", file=sys.stderr
        )
        return 2
    temp_local = args.local_dir is None
    local_dir = Path(args.local_dir or tempfile.mkdtemp(prefix="shufflefs-bench-local-"))
    try:
        with cluster(args) as (config, mount):
            args.config_path = str(config)
            data = prepare_dataset(args, config, mount, local_dir)
            print(
                f"dataset: {data.tokens:,} {data.dtype} tokens "
                f"({data.tokens * np.dtype(data.dtype).itemsize / 2**30:.2f} GiB) in {args.files} "
                f"files; seq_len {args.seq_len}; readahead {args.readahead}",
                file=sys.stderr,
            )
            results, notes = run(args, data)
    except (FsError, OSError) as exc:
        msg = exc.message if isinstance(exc, FsError) else str(exc)
        print(f"shufflefs bench loader: {msg}", file=sys.stderr)
        return 1
    finally:
        if temp_local:
            shutil.rmtree(local_dir, ignore_errors=True)
    size = data.tokens * np.dtype(data.dtype).itemsize
    title = (
        f"shuffled windows of {args.seq_len}+1 {data.dtype} tokens, {size / 2**30:.1f} GiB "
        f"in {args.files} files, readahead {args.readahead}"
    )
    if args.plot:
        plot(results, args.plot, title)
    if args.json:
        print(
            json.dumps(
                {
                    "dataset": {
                        "bytes": size,
                        "tokens": data.tokens,
                        "dtype": data.dtype,
                        "files": args.files,
                    },
                    "seq_len": args.seq_len,
                    "readahead": args.readahead,
                    "seed": args.seed,
                    "notes": notes,
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
        return 0
    print(title)
    for note in notes:
        print(f"note: {note}")
    for phase, what in (
        ("cold", "cold: page caches dropped before each run"),
        ("warm", "warm: the same windows read again, from the page caches"),
    ):
        text = table(results, phase)
        if text:
            print(f"\n{what}\n{text}")
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0
