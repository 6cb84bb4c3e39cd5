#!/usr/bin/env python3
"""Write throughput with 1 and 3 replicas, and resync throughput, in one run.

    .venv/bin/python bench/replication.py [--size-mb 512] [--workdir /var/tmp/sfs-repl]

For each replication factor it starts a local cluster of 3 storage nodes
(`shufflefs up --replicas R`), writes a file of SIZE through the mount in
1 MiB writes (fsync at the end) and reports MB/s beside the same write to a
local directory on the same disk. Then, with 3 replicas, it kills one storage
daemon, writes SIZE more, starts the daemon again and reports how long the
resync took and the throughput the daemon logged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
CLI = [sys.executable, "-m", "shufflefs.cluster.cli"]


def write_file(path: Path, size: int) -> float:
    block = os.urandom(MiB)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // MiB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return size / MiB / (time.perf_counter() - t0)


def status(data: Path) -> str:
    return subprocess.run(
        [*CLI, "status", "--json", "--config", str(data / "client.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--workdir", default="/var/tmp/sfs-repl")
    args = p.parse_args()
    size = args.size_mb * MiB
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    local = write_file(work / "local.bin", size)
    (work / "local.bin").unlink()
    print(f"local disk            {local:8.0f} MB/s  (1 MiB writes + fsync, {args.size_mb} MiB)")
    for replicas in (1, 3):
        data, mnt = work / f"r{replicas}", work / f"mnt{replicas}"
        subprocess.run(
            [
                *CLI,
                "up",
                "--data-dir",
                str(data),
                "--mountpoint",
                str(mnt),
                "--replicas",
                str(replicas),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            mbs = write_file(mnt / "w.bin", size)
            print(
                f"shufflefs replicas={replicas}  {mbs:8.0f} MB/s  ratio to local {mbs / local:.2f}"
            )
            if replicas == 3:
                pid = int((data / "run" / "storage3.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                time.sleep(5)  # offline after the heartbeat timeout; writes go on without it
                write_file(mnt / "while-down.bin", size)
                t0 = time.monotonic()
                subprocess.run(
                    [*CLI, "up", "--data-dir", str(data), "--no-mount"],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                while '"syncing"' in status(data) or '"offline"' in status(data):
                    time.sleep(0.2)
                took = time.monotonic() - t0
                log = (data / "logs" / "storage3.log").read_text()
                done = re.findall(
                    r"resync done .*bytes_copied=(\d+).*seconds=([\d.]+) "
                    r"throughput_mb_s=([\d.]+)",
                    log,
                )
                for copied, secs, mbps in done:
                    print(
                        f"resync: {int(copied) / MiB:.0f} MiB copied in {float(secs):.1f}s "
                        f"({float(mbps):.0f} MB/s, as the daemon logged it)"
                    )
                print(f"resync: node restarted to every target serving: {took:.1f}s")
        finally:
            subprocess.run([*CLI, "down", "--data-dir", str(data)], stdout=subprocess.DEVNULL)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
