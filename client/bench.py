"""``shufflefs bench``: the benchmarks, one sub-mode each.

``shufflefs bench loader ...`` measures training-data reads (shuffled token
windows through a local copy, the FUSE mount and the native client; see
`shufflefs.client.data.bench`). Modes are imported only when chosen, so the
heavy ones cost nothing to the others.
"""

from __future__ import annotations

import argparse
import sys


def cli_bench(args: argparse.Namespace) -> int:
    mode = getattr(args, "bench_mode", None)
    if mode == "loader":
        from shufflefs.client.data.bench import cli_loader

        return cli_loader(args)
    print("shufflefs bench: choose a mode: shufflefs bench loader [options]", file=sys.stderr)
    return 2
