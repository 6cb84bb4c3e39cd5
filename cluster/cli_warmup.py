"""`shufflefs warmup PATH...`: read a dataset once so that page caches hold it.

Every regular file under the PATHs (directories walked) is read once, whole,
a chunk at a time with ``--concurrency`` reads in flight, through the same
read path a training job uses (`FileSystem.read_into`): chunks of targets on
this host are read from their files here, the rest by the storage daemons
holding them, so the page cache of each storage host ends up holding its
part of the data, and the next epoch's first reads come from memory. A
progress bar (tqdm) goes to stderr on a terminal; totals go to stdout.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import trio
from tqdm import tqdm

from shufflefs.client.fs import FileSystem
from shufflefs.cluster.cli_files import cluster_path, with_filesystem
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

PIECE = 4 << 20  # bytes per read: a few chunks of the default size
MAX_FILES = 10_000_000


@dataclass
class Warmed:
    files: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def as_json(self, seconds: float) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(seconds, 3),
            "bytes_per_second": round(self.bytes / seconds) if seconds > 0 else None,
            "errors": self.errors,
        }


async def walk(fs: FileSystem, path: str, attr: Attr, out: list[tuple[str, Attr]]) -> None:
    """Every regular file at or under *path*, depth first, in name order."""
    if stat.S_ISREG(attr["mode"]):
        out.append((path, attr))
        return
    if not stat.S_ISDIR(attr["mode"]):
        return
    after: bytes | None = None
    while True:
        page = await fs.readdir(attr["ino"], after, 1024)
        for name, child in page["entries"]:
            if len(out) >= MAX_FILES:
                raise FsError(errno.EFBIG, f"more than {MAX_FILES} files under {path}")
            await walk(fs, f"{path.rstrip('/')}/{os.fsdecode(name)}", child, out)
        if not page["more"] or not page["entries"]:
            return
        after = page["entries"][-1][0]


async def warm_file(
    fs: FileSystem, path: str, attr: Attr, limit: trio.Semaphore, bar: Any, done: Warmed
) -> None:
    try:
        f, attr = await fs.open(attr["ino"], os.O_RDONLY)
    except FsError as exc:
        done.errors.append(f"{path}: {exc.message}")
        return
    try:
        async with trio.open_nursery() as nursery:
            for offset in range(0, attr["size"], PIECE):
                await limit.acquire()
                nursery.start_soon(warm_piece, fs, f, path, offset, limit, bar, done)
    finally:
        await fs.release(f.fh)
    done.files += 1


async def warm_piece(
    fs: FileSystem,
    f: Any,
    path: str,
    offset: int,
    limit: trio.Semaphore,
    bar: Any,
    done: Warmed,
) -> None:
    try:
        extents = fs.extents(f, ((offset, PIECE),))
        buf = bytearray(extents[0][3])
        if buf:
            await fs.read_into(extents, memoryview(buf))
        done.bytes += len(buf)
        bar.update(len(buf))
    except FsError as exc:
        done.errors.append(f"{path} at {offset}: {exc.message}")
    finally:
        limit.release()


async def warmup(fs: FileSystem, paths: list[str], concurrency: int) -> Warmed:
    files: list[tuple[str, Attr]] = []
    for path in paths:
        await walk(fs, path, await fs.resolve(path), files)
    done = Warmed()
    limit = trio.Semaphore(concurrency)
    with tqdm(
        total=sum(a["size"] for _, a in files),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="warmup",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    ) as bar:
        for path, attr in files:
            await warm_file(fs, path, attr, limit, bar, done)
    return done


def cli_warmup(args: argparse.Namespace) -> int:
    """``shufflefs warmup PATH... [--concurrency N] [--json]``."""
    paths = [cluster_path(p) for p in args.paths]
    started = time.monotonic()

    async def run(fs: FileSystem, mgmtd: MgmtdStub, rpc: RpcClient) -> Warmed:
        return await warmup(fs, paths, args.concurrency)

    done = with_filesystem(args, run)
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps(done.as_json(seconds)))
    else:
        rate = done.bytes / seconds / (1 << 20) if seconds > 0 else 0.0
        print(f"warmed {done.files} files, {done.bytes} bytes in {seconds:.1f}s ({rate:.1f} MiB/s)")
        for error in done.errors:
            print(f"  {error}")
    return 1 if done.errors else 0
