"""Open+read+close of files in a given order by several processes, each
hinting its next files to the shufflefs mount first: what a DataLoader's
workers do over a one-file-per-sample dataset with prefetch along the
shuffle. `shufflefs bench files` calls `read_rate` for its
``fuse-prefetch`` row (and with ``hint_ahead=0`` it is the plain row).
Caches are the caller's to drop."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator, Sequence

from shufflefs.client.data.mount_hints import DEFAULT_AHEAD, MountHints, lookahead

CHUNK = 16  # files hinted per setxattr


def _read_files(paths: Sequence[str], hint_ahead: int) -> int:
    hints = MountHints.find(paths, hint_ahead, whole_files=True) if hint_ahead > 0 else None

    def chunks() -> Iterator[range]:
        for lo in range(0, len(paths), CHUNK):
            yield range(lo, min(lo + CHUNK, len(paths)))

    order: Iterator[range] = chunks()
    if hints is not None:
        order = lookahead(order, hint_ahead, lambda r: hints.files(list(r)), len)
    total = 0
    for r in order:
        for i in r:
            with open(paths[i], "rb") as f:
                total += len(f.read())
    if hints is not None:
        hints.close()
    return total


def _worker(args: tuple[Sequence[str], int]) -> int:
    return _read_files(*args)


def read_rate(paths: Sequence[str], procs: int = 4, hint_ahead: int = DEFAULT_AHEAD) -> float:
    """Samples/s reading *paths* in order, path ``i`` by process ``i % procs``;
    with *hint_ahead* > 0 and the paths on a shufflefs mount, each process
    hints its next *hint_ahead* files (nothing is hinted elsewhere)."""
    shares = [(list(paths[p::procs]), hint_ahead) for p in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        t0 = time.perf_counter()
        pool.map(_worker, shares, chunksize=1)
        elapsed = time.perf_counter() - t0
    return len(paths) / elapsed
