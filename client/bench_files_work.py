"""The measuring side of ``shufflefs bench files``: the file set's shape,
the timed operations, the worker processes that run them, and an
ImageFolder-style ``Dataset`` for the DataLoader row.

Every operation runs in worker processes (spawned once, reused for every
row) and each worker times its own share (``time.monotonic`` is one clock
for every process on the machine), so a row's rate is the operations of all
its workers over the span from the first start to the last end: process
start-up and task dispatch are not counted.

Every file's first `HEADER` bytes are its index in decimal, so a read of the
wrong file (or of stale bytes) is caught, by name, in every row.
"""

from __future__ import annotations

import functools
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from shufflefs.client.iobench import ProcessPool

HEADER = 12  # bytes of the decimal file index at the start of every file
NATIVE_BATCH = 32  # files per FileDataset.__getitems__ call (as a DataLoader batch asks)


@dataclass(frozen=True)
class FileSet:
    """N files of S bytes in C class directories, ImageFolder-shaped:
    ``class0007/0001234.bin``; file i lives in directory i * C // N."""

    files: int
    size: int
    dirs: int

    def directory(self, i: int) -> str:
        return f"class{i * self.dirs // self.files:04d}"

    def name(self, i: int) -> str:
        return f"{self.directory(i)}/{i:07d}.bin"

    def directories(self) -> list[str]:
        return sorted({self.directory(i) for i in range(self.files)})

    def shuffled(self, seed: int, count: int | None = None) -> list[int]:
        """The first *count* file indices of a shuffled order."""
        order = list(range(self.files))
        random.Random(seed).shuffle(order)
        return order[: self.files if count is None else count]


def header(i: int) -> bytes:
    return f"{i:0{HEADER}d}".encode()


def index_of(name: str) -> int:
    """The file index a name carries (``.../0001234.bin`` -> 1234)."""
    return int(os.path.basename(name).split(".")[0])


def split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """*items* in *parts* contiguous slices of (nearly) equal length."""
    n = len(items)
    return [list(items[k * n // parts : (k + 1) * n // parts]) for k in range(parts)]


def check_bytes(name: str, data: bytes | memoryview, size: int) -> None:
    if len(data) != size or bytes(data[:HEADER]) != header(index_of(name)):
        raise ValueError(f"{name}: read {len(data)} bytes, not the {size} written there")


# ---- the timed operations (one worker's share) -----------------------------------------


def do_create(root: str, names: Sequence[str], size: int) -> int:
    buf = bytearray(os.urandom(size))
    for name in names:
        buf[:HEADER] = header(index_of(name))
        with open(os.path.join(root, name), "wb") as f:
            f.write(buf)
    return len(names)


def do_stat(root: str, names: Sequence[str], size: int) -> int:
    for name in names:
        if os.stat(os.path.join(root, name)).st_size != size:
            raise ValueError(f"{name}: stat says another size than the {size} written")
    return len(names)


def do_scan(root: str, dirs: Sequence[str], size: int) -> int:
    entries = 0
    for d in dirs:
        with os.scandir(os.path.join(root, d)) as it:
            for _ in it:
                entries += 1
    return entries


def do_read(root: str, names: Sequence[str], size: int, buffering: int = -1) -> int:
    """``open(path, "rb")``, read, close: what a Dataset's ``__getitem__``
    does (PIL's ``Image.open(path)`` too). With *buffering* 0, the open
    that asks no ioctl of the file (`--unbuffered`)."""
    for name in names:
        with open(os.path.join(root, name), "rb", buffering=buffering) as f:
            check_bytes(name, f.read(), size)
    return len(names)


def do_prefetch_read(root: str, names: Sequence[str], size: int, buffering: int = -1) -> int:
    """`do_read` with each worker hinting its next files to the mount
    (client/data/hinted_reads.py), as a DataLoader over the mount does."""
    from shufflefs.client.data.hinted_reads import read_files

    paths = [os.path.join(root, n) for n in names]
    for name, data in zip(names, read_files(paths, buffering=buffering), strict=True):
        check_bytes(name, data, size)
    return len(names)


_datasets: dict[tuple[str, str], Any] = {}


def native_dataset(url: str, config: str) -> Any:
    """One FileDataset per (url, config) and worker: its listing is set-up,
    not part of any row."""
    key = (url, config)
    if key not in _datasets:
        from shufflefs.client.data.datasets import FileDataset

        _datasets[key] = FileDataset(url, config=config)
    return _datasets[key]


def do_native_read(spec: str, names: Sequence[str], size: int) -> int:
    url, _, config = spec.partition("\n")
    ds = native_dataset(url, config)
    where = {index_of(p): k for k, p in enumerate(ds.files)}
    wanted = [where[index_of(n)] for n in names]
    for start in range(0, len(wanted), NATIVE_BATCH):
        batch = wanted[start : start + NATIVE_BATCH]
        for k, item in zip(batch, ds.__getitems__(batch), strict=True):
            check_bytes(ds.files[k], memoryview(item).cast("B"), size)
    return len(names)


def do_import(spec: str, names: Sequence[str], size: int) -> int:
    """`shufflefs import` of the local set (*spec*: its root, the cluster
    path to copy it to and the client config, a line each): one process,
    its files in flight together (client/ingest.py)."""
    from shufflefs.client import Client

    source, dest, config = spec.split("\n")
    with Client(config) as client:
        done = client.import_tree(source, dest)
    if done.failed or done.files != len(names):
        problems = [*done.errors[:3], *([done.stopped] if done.stopped else [])]
        raise ValueError(f"import: {done.files} of {len(names)} files; {problems}")
    return done.files


OPERATIONS: dict[str, Callable[[str, Sequence[str], int], int]] = {
    "create": do_create,
    "import": do_import,
    "stat": do_stat,
    "scan": do_scan,
    "read": do_read,
    "prefetch-read": do_prefetch_read,
    # (`--unbuffered`: Python before 3.14 asks each file opened buffered
    # whether it is a terminal, an ioctl that FUSE hands to the mount)
    "read-unbuffered": functools.partial(do_read, buffering=0),
    "prefetch-read-unbuffered": functools.partial(do_prefetch_read, buffering=0),
    "native-read": do_native_read,
    "native-setup": lambda root, names, size: 0,  # the set-up alone (see `run_task`)
}

Task = tuple[str, str, list[str], int]  # (operation, root, names or directories, file size)


def run_task(task: Task) -> tuple[int, float, float]:
    op, root, items, size = task
    if op.startswith("native-"):  # set-up outside the timed span
        url, _, config = root.partition("\n")
        native_dataset(url, config)
    start = time.monotonic()
    count = OPERATIONS[op](root, items, size)
    return count, start, time.monotonic()


def worker_main(conn: Connection, index: int, netns: str | None = None) -> None:
    """One worker of the pool (*index*: which), on host *netns* if given
    (`shufflefs bench files --remote`: a reader host)."""
    if netns:  # first, before the worker opens a socket or starts a thread
        from shufflefs.cluster.netns import enter

        enter(netns)
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            conn.send(run_task(task))
        except Exception as exc:  # tell the parent rather than die silently
            conn.send(("error", f"{type(exc).__name__}: {exc}", 0.0))


class WorkerPool(ProcessPool):
    """P worker processes (`worker_main`), on host *netns* if given."""

    def __init__(self, n: int, netns: str | None = None) -> None:
        super().__init__(n, worker_main, netns)

    def run(self, tasks: Sequence[Task]) -> tuple[int, float]:
        """Run one task per worker, all at once: (operations, seconds)."""
        if len(tasks) > len(self.conns):
            raise ValueError(f"{len(tasks)} tasks for {len(self.conns)} workers")
        for conn, task in zip(self.conns, tasks, strict=False):
            conn.send(task)
        results = [conn.recv() for conn in self.conns[: len(tasks)]]
        for r in results:
            if r[0] == "error":
                raise RuntimeError(f"{tasks[0][0]} in {tasks[0][1]}: a worker failed: {r[1]}")
        count = sum(r[0] for r in results)
        span = max(r[2] for r in results) - min(r[1] for r in results)
        return count, max(span, 1e-9)


# ---- the DataLoader row --------------------------------------------------------------------


class ImageFolderFiles:
    """What an ImageFolder does per sample, without decoding: the class is
    the directory, the sample is the file's bytes (open, read, close)."""

    def __init__(self, root: str, names: Sequence[str], size: int) -> None:
        self.root = root
        self.names = list(names)
        self.size = size
        classes = sorted({os.path.dirname(n) for n in self.names})
        self.class_of = {c: k for k, c in enumerate(classes)}

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, k: int) -> tuple[Any, int]:
        import numpy as np

        name = self.names[k]
        data = bytearray(self.size + 1)  # one byte more: a longer file is caught
        with open(os.path.join(self.root, name), "rb", buffering=0) as f:
            n = f.readinto(data)
        check_bytes(name, memoryview(data)[:n], self.size)
        sample = np.frombuffer(data, dtype=np.uint8)[: self.size]
        return sample, self.class_of[os.path.dirname(name)]


def loader_rate(root: str, names: Sequence[str], size: int, workers: int, seed: int) -> float:
    """Samples/s of ``torch.utils.data.DataLoader(num_workers=workers)``
    over *names* in a shuffled order, counted from the first batch (worker
    start-up excluded)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Files(ImageFolderFiles, Dataset):
        pass

    batch = 32
    # torch warns that 4 workers exceed this machine's cores: we ask for them
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    loader = DataLoader(
        Files(root, names, size),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
    )
    began = time.monotonic()
    it = iter(loader)
    first = next(it)
    start = time.monotonic()
    samples = 0
    for data, _labels in it:
        samples += len(data)
    seconds = time.monotonic() - start
    if samples == 0:  # one batch only: nothing to time after it, count from the start
        return len(first[0]) / max(time.monotonic() - began, 1e-9)
    return samples / max(seconds, 1e-9)
