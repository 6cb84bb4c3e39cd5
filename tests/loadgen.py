"""Load loops run as separate processes during fault tests.

    python loadgen.py read  FILE SEED SECONDS REPORT   # random O_DIRECT reads, checked
    python loadgen.py write DIR SECONDS ACKLOG           # files written and closed, logged

Both are bounded in time, and stop early on SIGUSR2 (`stop`: a test ends
the load once what it waited for has happened). The reader checks every byte it reads against the
file's known content (a pure function of SEED), keeps the number of reads so
far in REPORT.progress (so a test can wait until the load is under way), and
at the end writes a JSON report: how many reads, how many failed (an error),
how many returned wrong bytes, and the longest single read. The writer
appends one line per file whose close() returned (acknowledged), with its
SHA-256, fsynced before the next file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

BLOCK = 4096
_stop = False


def _stop_now(signum: int, frame: object) -> None:
    global _stop
    _stop = True


def stop(*procs: subprocess.Popen[bytes]) -> None:
    """Ask running load loops to finish now (they write their report)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR2)


def content(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def write_progress(report: str, reads: int) -> None:
    tmp = f"{report}.progress.tmp"
    with open(tmp, "w") as f:
        f.write(str(reads))
    os.replace(tmp, f"{report}.progress")


def read_loop(path: str, seed: int, seconds: float, report: str) -> None:
    size = os.path.getsize(path)
    expected = content(seed, size)
    rng = random.Random(seed)
    buf = mmap.mmap(-1, 64 * BLOCK)
    reads = failures = wrong = 0
    longest = 0.0
    errors: list[str] = []
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    deadline = time.monotonic() + seconds
    next_progress = 0.0
    while time.monotonic() < deadline and not _stop:
        if time.monotonic() >= next_progress:
            write_progress(report, reads)
            next_progress = time.monotonic() + 0.2
        n = rng.choice((1, 2, 16))  # 4 KiB, 8 KiB, 64 KiB
        off = rng.randrange(0, size // BLOCK - n) * BLOCK
        t0 = time.monotonic()
        try:
            got = os.preadv(fd, [memoryview(buf)[: n * BLOCK]], off)
        except OSError as exc:
            failures += 1
            errors.append(f"{exc.errno}: {exc.strerror}")
            got = -1
        longest = max(longest, time.monotonic() - t0)
        reads += 1
        if got >= 0 and buf[: n * BLOCK] != expected[off : off + n * BLOCK]:
            wrong += 1
    os.close(fd)
    with open(report, "w") as f:
        json.dump(
            {
                "reads": reads,
                "failures": failures,
                "wrong": wrong,
                "longest_s": longest,
                "errors": errors[:10],
            },
            f,
        )


def write_loop(directory: str, seconds: float, acklog: str) -> None:
    deadline = time.monotonic() + seconds
    i = 0
    with open(acklog, "a") as out:
        while time.monotonic() < deadline and not _stop:
            data = os.urandom(((i * 7919) % 1_500_000) + 1000)
            path = os.path.join(directory, f"w{i}")
            try:
                with open(path, "wb") as f:
                    f.write(data)
            except OSError as exc:
                out.write(f"ERROR {path} {exc.errno}\n")
                out.flush()
                time.sleep(0.05)
                i += 1
                continue
            out.write(f"{path} {hashlib.sha256(data).hexdigest()} {time.time():.3f}\n")
            out.flush()
            os.fsync(out.fileno())
            i += 1


if __name__ == "__main__":
    signal.signal(signal.SIGUSR2, _stop_now)
    mode = sys.argv[1]
    if mode == "read":
        read_loop(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    elif mode == "write":
        write_loop(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
