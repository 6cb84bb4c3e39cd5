"""``shufflefs sample startup``: the order costs nothing to start, at any size.

Loaders that keep a table of sample ids (MosaicML Streaming's shared-memory
index, Megatron's .npy index arrays) pay for it at start-up: time and memory
that grow with the dataset. Here the order is arithmetic, so both must stay
flat from a million samples to a trillion. Each measurement runs in a fresh
process: build the dataset over sparse token files (one-byte tokens,
``seq_len=1``, ``stride=1``: one sample per byte, no data written), resume it
at the middle of the epoch as rank 47 of 48, and take the first batch. The
time is from the constructor to the first batch in hand (imports excluded);
the memory is the peak resident size minus that of the same process before
the constructor. The 3-component mixture splits the same number of samples
0.5 / 0.3 / 0.2 over three files.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 48
RANK = 47


def sparse(path: Path, samples: int) -> str:
    """A token file of *samples* one-byte windows of seq_len 1 (samples + 1 bytes)."""
    if not path.exists() or path.stat().st_size != samples + 1:
        with open(path, "wb") as f:
            f.truncate(samples + 1)
    return str(path)


def measure_one(kind: str, samples: int, directory: Path, batch: int) -> dict[str, Any]:
    """In this (fresh) process: time to the first batch and the memory it took."""
    from shufflefs.client.data import Mixture, TokenWindows

    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    common: dict[str, Any] = dict(seq_len=1, dtype="uint8", stride=1)
    ds: Any
    if kind == "tokens":
        path = sparse(directory / f"tokens-{samples}.bin", samples)
        ds = TokenWindows([path], rank=RANK, world_size=WORLD, batch_size=batch, **common)
    else:
        shares = (samples // 2, samples * 3 // 10, samples - samples // 2 - samples * 3 // 10)
        parts = [
            TokenWindows([sparse(directory / f"part{i}-{n}.bin", n)], **common)
            for i, n in enumerate(shares)
        ]
        ds = Mixture(parts, weights=[0.5, 0.3, 0.2], rank=RANK, world_size=WORLD, batch_size=batch)
    n = ds.shard.n
    state = ds.state_dict(consumed=0)
    state["position"] = n // 2  # a resume in the middle of the epoch
    ds.load_state_dict(state)
    first = next(iter(ds.iter_batches()))
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ds.close()
    return {
        "kind": kind,
        "samples": n,
        "first_batch_rows": len(first),
        "seconds": seconds,
        "memory_mib": (peak_kib - base_kib) / 1024,
        "peak_rss_mib": peak_kib / 1024,
    }


def cli_startup(args: argparse.Namespace) -> int:
    try:
        sizes = [int(float(x)) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        print("shufflefs sample startup: --sizes are numbers like 1e6,1e9", file=sys.stderr)
        return 2
    temp = args.dir is None
    directory = Path(args.dir or tempfile.mkdtemp(prefix="shufflefs-startup-"))
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for kind in ("tokens", "mixture"):
            for n in sizes:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        __name__,
                        kind,
                        str(n),
                        str(directory),
                        str(args.batch_size),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode != 0:
                    print(f"shufflefs sample startup: {out.stderr.strip()}", file=sys.stderr)
                    return 1
                rows.append(json.loads(out.stdout))
    finally:
        if temp:
            for f in directory.iterdir():
                f.unlink()
            directory.rmdir()
    if args.json:
        print(json.dumps({"rank": RANK, "world_size": WORLD, "rows": rows}, indent=2))
        return 0
    print(f"first batch of {args.batch_size} after a resume at mid-epoch, rank {RANK} of {WORLD}:")
    print(f"{'order':>8} {'samples':>15} {'time to first batch':>20} {'memory':>10}")
    for r in rows:
        print(
            f"{r['kind']:>8} {r['samples']:>15,} {r['seconds'] * 1000:>17.1f} ms "
            f"{r['memory_mib']:>7.2f} MiB"
        )
    return 0


if __name__ == "__main__":
    kind, n, where, batch = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(measure_one(kind, n, where, batch)))
