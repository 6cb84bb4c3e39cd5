#!/usr/bin/env python3
"""A quick read/write measurement: the same operations on the mount and on a
local directory of the same disk, in one run, reported as ratios to local.

    .venv/bin/python bench/quick_rw.py --mount mnt --local /var/tmp/qrw

Run as root to drop the page caches before the cold passes
(``echo 3 > /proc/sys/vm/drop_caches``: the storage daemons' caches too).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shufflefs.client.iobench import drop_caches

MiB = 1 << 20


def seq_write(d: Path, size: int) -> float:
    block = os.urandom(MiB)
    t0 = time.perf_counter()
    with open(d / "seq.bin", "wb") as f:
        for _ in range(size // MiB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return size / MiB / (time.perf_counter() - t0)


def seq_read(d: Path, size: int) -> float:
    t0 = time.perf_counter()
    with open(d / "seq.bin", "rb", buffering=0) as f:
        while f.read(MiB):
            pass
    return size / MiB / (time.perf_counter() - t0)


def rand_read(d: Path, size: int, n: int, bs: int, direct: bool) -> tuple[float, float]:
    """IOPS and p50 latency (us) of n random bs-byte reads."""
    rng = random.Random(0)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(d / "seq.bin", flags)
    import mmap

    buf = mmap.mmap(-1, bs)  # page aligned, as O_DIRECT wants
    lat = []
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            off = rng.randrange(0, size // bs) * bs
            s = time.perf_counter()
            os.preadv(fd, [buf], off)
            lat.append(time.perf_counter() - s)
        total = time.perf_counter() - t0
    finally:
        os.close(fd)
    return n / total, statistics.median(lat) * 1e6


def small_files(d: Path, n: int) -> tuple[float, float]:
    """files/s created (4 KiB each, written and closed), then stat'ed."""
    sub = d / "small"
    sub.mkdir(exist_ok=True)
    data = os.urandom(4096)
    t0 = time.perf_counter()
    for i in range(n):
        with open(sub / f"f{i}", "wb") as f:
            f.write(data)
    create = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(n):
        os.stat(sub / f"f{i}")
    return create, n / (time.perf_counter() - t0)


def run(d: Path, size: int, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["seq write MB/s"] = seq_write(d, size)
    cold = drop_caches()
    out[f"seq read MB/s ({'cold' if cold else 'cache not dropped'})"] = seq_read(d, size)
    out["seq read MB/s (warm)"] = seq_read(d, size)
    drop_caches()
    iops, p50 = rand_read(d, size, n, 4096, direct=True)
    out["4k rand read IOPS (O_DIRECT, cold)"] = iops
    out["4k rand read p50 us (O_DIRECT, cold)"] = p50
    iops, p50 = rand_read(d, size, n, 4096, direct=True)
    out["4k rand read IOPS (O_DIRECT, server warm)"] = iops
    out["4k rand read p50 us (O_DIRECT, server warm)"] = p50
    creates, stats = small_files(d, 1000)
    out["4 KiB file creates/s"] = creates
    out["stat/s"] = stats
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mount", required=True, help="a directory on the shufflefs mount")
    p.add_argument("--local", required=True, help="a directory on a local disk")
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--reads", type=int, default=5000)
    args = p.parse_args()
    size = args.size_mb * MiB
    results: dict[str, dict[str, float]] = {}
    for label, base in (("local", Path(args.local)), ("shufflefs", Path(args.mount))):
        d = base / f"quick_rw_{os.getpid()}"
        d.mkdir(parents=True)
        try:
            results[label] = run(d, size, args.reads)
        finally:
            shutil.rmtree(d)
    fmt: Callable[[float], str] = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"  # noqa: E731
    print(f"{'operation':<44} {'local':>10} {'shufflefs':>10} {'ratio':>7}")
    for key, local in results["local"].items():
        ours = results["shufflefs"][key]
        ratio = local / ours if "p50" in key else ours / local
        print(f"{key:<44} {fmt(local):>10} {fmt(ours):>10} {ratio:>7.2f}")
    print("ratio = shufflefs / local (for latencies: local / shufflefs), same machine, same run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
