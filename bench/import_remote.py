#!/usr/bin/env python3
"""`shufflefs import` from a training node that is not a storage host, and
the CPU each service spends per file: a fresh cluster of network-namespace
hosts (cluster/netns_cluster.py: storage daemons on hosts of their own, the
import on a reader host), the same local set imported --rounds times into
new directories, then everything removed.

    .venv/bin/python bench/import_remote.py SOURCE --replicas 3 --rounds 2

Per round: files/s as the import reports it, and the CPU per file of the
import process (`/usr/bin/time`), of the storage daemons together (user and
the kernel's share) and of the metadata server (`/proc/PID/stat`). The
first round also pays for the cluster's start (directories, connections):
compare later rounds. Root (network namespaces).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shufflefs.cluster.netns_cluster import RemoteCluster

TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> tuple[float, float]:
    """(user, system) seconds of process *pid*."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK, int(fields[12]) * TICK


def ms(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    names: list[str],
    files: int,
    part: int | None = None,
) -> float:
    """CPU ms per file of the processes *names* (*part*: 0 user, 1 kernel)."""
    parts = (0, 1) if part is None else (part,)
    return sum(after[n][p] - before[n][p] for n in names for p in parts) * 1e3 / files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a local directory of files to import")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--storage-hosts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, help="files in flight (default: import's)")
    args = ap.parse_args()
    files = sum(len(names) for _, _, names in os.walk(args.source))
    if not files:
        sys.exit(f"{args.source}: no files")
    with (
        tempfile.TemporaryDirectory(prefix="shufflefs-import-") as work,
        RemoteCluster(Path(work), args.storage_hosts, 1, replicas=args.replicas) as cluster,
    ):
        run = cluster.local.dir / "run"
        pids = {f.stem: int(f.read_text()) for f in run.glob("*.pid")}
        storage = [name for name in pids if name.startswith("storage")]
        extra = [] if args.concurrency is None else ["--concurrency", str(args.concurrency)]
        for r in range(args.rounds):
            before = {name: cpu(pid) for name, pid in pids.items()}
            started = time.perf_counter()
            done = subprocess.run(
                [
                    *("ip", "netns", "exec", cluster.reader_netns()),
                    *("/usr/bin/time", "-f", "%U %S"),
                    *(sys.executable, "-m", "shufflefs.cluster.cli", "import"),
                    *("--config", str(cluster.client_config), *extra, args.source, f"/round{r}"),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            seconds = time.perf_counter() - started
            after = {name: cpu(pid) for name, pid in pids.items()}
            if done.returncode:
                sys.exit(f"import failed: {done.stdout[-500:]}{done.stderr[-500:]}")
            user, system = map(float, done.stderr.strip().splitlines()[-1].split())
            rate = re.search(r"\(([\d,]+) files/s", done.stdout)

            print(
                f"replicas={args.replicas} round {r}: {rate.group(1) if rate else '?'} files/s "
                f"({files / seconds:,.0f} with the start-up); CPU per file: import "
                f"{(user + system) * 1e3 / files:.2f} ms, "
                f"storage {ms(before, after, storage, files):.2f} ms "
                f"(kernel {ms(before, after, storage, files, 1):.2f}), "
                f"meta {ms(before, after, ['meta'], files):.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
