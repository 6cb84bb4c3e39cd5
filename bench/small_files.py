#!/usr/bin/env python3
"""Small-file creation through the native client, without FUSE: how fast the
write path (metadata create, the chain write, the length report, release)
creates one-file-per-sample datasets, with 1 and P processes.

    .venv/bin/python bench/small_files.py [--files 600] [--size 110K] [--procs 1 4 16]

Starts a cluster (`shufflefs up --no-mount`, 3 storage nodes, 3 replicas,
fsync on) in --workdir (default: a new directory in /var/tmp, on the disk),
then, for each process count P, P processes each with its own `Client`
write their share of --files files (`write_bytes`: create, write, close)
into their own directory. Prints one line per P (files/s, mean ms per file
per process, and CPU ms per file of the clients and of each kind of
service: on a shared machine the CPU is often what bounds it), then, per
storage target, its group flushes (the daemon logs
them when it stops: flushes and passes, record commits and transactions).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "shufflefs.cluster.cli"]


def writer(config: str, root: str, count: int, size: int, start: mp.Barrier) -> None:  # type: ignore[type-arg]
    from shufflefs.client import Client

    data = os.urandom(size)
    with Client(config) as client:
        client.makedirs(root, exist_ok=True)
        start.wait()
        for i in range(count):
            client.write_bytes(f"{root}/f{i}", data)


def service_cpu(data: Path) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each service process of
    the cluster in *data*, by its command line."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if not any(str(data).encode() in part for part in cmdline):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = next((a.decode() for a in cmdline if a in (b"storage", b"meta", b"mgmtd")), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(config: str, procs: int, files: int, size: int, tag: str) -> tuple[float, float]:
    per = max(1, files // procs)
    start = mp.Barrier(procs + 1)
    workers = [
        mp.Process(target=writer, args=(config, f"/{tag}/p{p}", per, size, start))
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    start.wait(timeout=120)
    t0 = time.perf_counter()
    for w in workers:
        w.join(900)
        if w.exitcode != 0:
            raise SystemExit(f"a writer failed (exit {w.exitcode})")
    seconds = time.perf_counter() - t0
    return per * procs / seconds, seconds / per * 1000


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=600)
    ap.add_argument("--size", default="110K")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sfs-small-", dir="/var/tmp"))
    data = work / "cluster"
    subprocess.run(
        [*CLI, "up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "3"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        config = str(data / "client.toml")
        for procs in args.procs:
            before, clients = service_cpu(data), children_cpu()
            rate, ms = run(config, procs, args.files, parse_size(args.size), f"p{procs}")
            after = service_cpu(data)
            n = max(1, args.files // procs) * procs
            cpu = " ".join(
                f"{k}={(after[k] - before.get(k, 0.0)) / n * 1000:.1f}" for k in sorted(after)
            )
            print(
                f"procs={procs} files_per_s={rate:.0f} ms_per_file={ms:.1f} "
                f"cpu_ms_per_file: client={(children_cpu() - clients) / n * 1000:.1f} {cpu}",
                flush=True,
            )
    finally:
        subprocess.run([*CLI, "down", "--data-dir", str(data)], stdout=subprocess.DEVNULL)
        for log in sorted(data.rglob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "group flushes" in line:
                    print(line.split(": ", 1)[-1])
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
