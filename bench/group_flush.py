#!/usr/bin/env python3
"""One target's durable small writes with and without group flushes: T
threads each write new chunks of --size bytes (`ChunkStore.write`: pwrite,
flush, record commit, fsync on) into one target, once with batches of one
(every write pays its own fsyncs and LMDB commit, as before group flushes)
and once grouped (storage/group_sync.py).

    .venv/bin/python bench/group_flush.py [--threads 1 4 16] [--writes 400] [--size 110K]

The target lives under --dir (default: a new directory in /var/tmp, on the
disk, so each flush costs what it costs). The modes alternate, --repeat
times each (the disk is shared: compare neighbours). One line per run:
writes/s, and the writes per file-flush pass and per transaction.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from shufflefs.storage.group_sync import FileSync, GroupRunner
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

CHUNK = 1 << 20


def one_run(path: Path, threads: int, writes: int, size: int, grouped: bool) -> str:
    store = ChunkStore(path, fsync=True, reserve_bytes=0)
    if not grouped:
        store._file_sync = FileSync(max_batch=1)
        store._record_commits = GroupRunner(store._commit_batch, max_batch=1)
    data = os.urandom(size)
    per = max(1, writes // threads)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(per):
                store.write(chunk_id(t * 1_000_000 + i + 1, 0), 0, CHUNK, data)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    seconds = time.perf_counter() - t0
    files, commits = store._file_sync.runner, store._record_commits
    store.close()
    shutil.rmtree(path)
    if errors:
        raise SystemExit(f"a writer failed: {errors[0]}")
    return (
        f"{'grouped' if grouped else 'one-by-one':>10} threads={threads:<3} "
        f"writes_per_s={per * threads / seconds:6.0f} "
        f"per_flush_pass={files.items / max(1, files.batches):.1f} "
        f"per_transaction={commits.items / max(1, commits.batches):.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--writes", type=int, default=400)
    ap.add_argument("--size", type=int, default=110 << 10)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="sfs-group-", dir="/var/tmp"))
    try:
        for threads in args.threads:
            for _ in range(args.repeat):
                for grouped in (False, True):
                    line = one_run(base / "t", threads, args.writes, args.size, grouped)
                    print(line, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
