"""``shufflefs bench``: the benchmarks.

``shufflefs bench [options]`` measures random-read IOPS and latency four
ways in (`shufflefs.client.iobench`); ``shufflefs bench loader ...`` measures
training-data reads (shuffled token windows, `shufflefs.client.data.bench`);
``shufflefs bench files ...`` one-file-per-sample datasets
(`shufflefs.client.bench_files`).
``shufflefs bench --remote`` the first from reader hosts off the storage hosts
(`shufflefs.client.iobench_remote`).
Modes are imported only when chosen, so the heavy ones cost nothing to the
others.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)


def cli_bench(args: argparse.Namespace) -> int:
    # SIGTERM (a job runner's stop, `kill`) unwinds like Ctrl-C: the cluster,
    # mounts and files a benchmark started are stopped and removed on the way
    # out, not left running
    signal.signal(signal.SIGTERM, _exit_on_term)
    mode = getattr(args, "bench_mode", None)
    if mode == "loader":
        from shufflefs.client.data.bench import cli_loader

        return cli_loader(args)
    if mode == "files":
        from shufflefs.client.bench_files import cli_files

        return cli_files(args)
    if args.remote:
        from shufflefs.client.iobench_remote import cli_remote

        return cli_remote(args)
    from shufflefs.client.iobench import cli_io

    return cli_io(args)
