"""`shufflefs import SRC DEST`: copy a local directory tree (a dataset) into
the cluster, many files in flight, without a mount (client/ingest.py).

A progress bar (tqdm, files and bytes) goes to stderr on a terminal; the
totals, what was left out and what failed go to stdout, or one JSON object
with ``--json``. Exit 0 when everything was copied (or skipped as already
there), 1 when a file failed or the cluster stopped taking files.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from typing import Any

from tqdm import tqdm

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.client.ingest import Imported, Importer
from shufflefs.cluster.cli_errors import UsageError, innermost
from shufflefs.cluster.cli_files import FSTYPE, cluster_path, with_filesystem
from shufflefs.cluster.preflight import mount_of
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.rpc.client import RpcClient

SHOWN = 20  # problems listed in the text output (all of them with --json)


def _report(done: Imported, seconds: float) -> None:
    mib = done.bytes / (1 << 20)
    rate = f"{done.files / seconds:,.0f} files/s, {mib / seconds:,.1f} MiB/s" if seconds > 0 else ""
    print(
        f"imported {done.files:,} files ({mib:,.1f} MiB), {done.dirs:,} directories, "
        f"{done.links:,} links in {seconds:.1f}s ({rate}); {done.skipped:,} already there"
    )
    problems = [f"left out: {p}" for p in done.left_out] + [f"failed: {p}" for p in done.errors]
    for line in problems[:SHOWN]:
        print(f"  {line}")
    more = len(problems) - SHOWN + done.unnamed
    if more > 0:
        print(f"  ... and {more:,} more (--json lists up to 1,000)")
    if done.stopped is not None:
        print(f"stopped: the cluster takes no more files: {done.stopped}")


def cli_import(args: argparse.Namespace) -> int:
    """``shufflefs import SRC DEST [--concurrency N] [--skip-existing] [--json]``."""
    source = os.path.abspath(args.source)
    if not os.path.lexists(source):
        raise UsageError(f"{args.source}: no such file or directory", errno.ENOENT)
    dest = cluster_path(args.dest)
    mount = mount_of(source)
    if mount is not None and mount.fstype == FSTYPE:  # a tree on a shufflefs mount
        inside = cluster_path(source).rstrip("/") + "/"
        if (dest.rstrip("/") + "/").startswith(inside):
            raise UsageError(f"{args.dest} is inside {args.source}: it would copy itself forever")
    started = time.monotonic()
    importer: Importer | None = None

    async def run(fs: FileSystem, mgmtd: MgmtdStub, rpc: RpcClient) -> Imported:
        with tqdm(
            unit=" files",
            desc="import",
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
        ) as bar:
            written = [0]

            def progress(files: int, nbytes: int) -> None:
                written[0] += nbytes
                bar.update(files)
                bar.set_postfix_str(f"{written[0] / (1 << 20):,.0f} MiB", refresh=False)

            nonlocal importer
            importer = Importer(
                fs,
                concurrency=args.concurrency,
                skip_existing=args.skip_existing,
                progress=progress,
            )
            return await importer.run(source, dest)

    # the client's usual retries: a server that fails over mid-import is ridden through
    try:
        done = with_filesystem(args, run, ClientOptions(local_reads=False))
    except BaseException as raised:
        if isinstance(innermost(raised), KeyboardInterrupt) and importer is not None:
            d = importer.done  # (what was done so far; the files in flight may be short)
            print(
                f"interrupted after {d.files:,} files ({d.skipped:,} already there): "
                "run it again with --skip-existing to finish",
                file=sys.stderr,
            )
        raise
    seconds = time.monotonic() - started
    if args.json:
        out: dict[str, Any] = done.as_json(seconds)
        print(json.dumps(out))
    else:
        _report(done, seconds)
    return 1 if done.failed else 0
