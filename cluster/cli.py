"""The ``shufflefs`` command.

User mistakes (a bad flag, a missing config, an unreachable cluster) end with
one line on stderr and a non-zero exit code, never a traceback. Service
subcommands import their component lazily, so ``shufflefs status`` does not
load pyfuse3 and ``shufflefs storage`` does not load the metadata server.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from shufflefs.rpc.errors import FsError

DEFAULT_DATA_DIR = ".shufflefs"
DEFAULT_MOUNTPOINT = "mnt"
CONFIG_ENV = "SHUFFLEFS_CONFIG"

# subcommand -> (module, function taking the parsed args and returning an exit code)
COMMANDS: dict[str, tuple[str, str]] = {
    "mgmtd": ("shufflefs.cluster.mgmtd", "cli_main"),
    "meta": ("shufflefs.metadata.server", "cli_main"),
    "storage": ("shufflefs.storage.server", "cli_main"),
    "up": ("shufflefs.cluster.launcher", "cli_up"),
    "down": ("shufflefs.cluster.launcher", "cli_down"),
    "format": ("shufflefs.cluster.launcher", "cli_format"),
    "status": ("shufflefs.cluster.admin", "cli_status"),
    "scrub": ("shufflefs.cluster.scrub", "cli_scrub"),
    "target": ("shufflefs.cluster.targets", "cli_target"),
    "mount": ("shufflefs.fuse.mount", "cli_mount"),
    "umount": ("shufflefs.fuse.mount", "cli_umount"),
    "sample": ("shufflefs.client.data.explain", "cli_sample"),
    "bench": ("shufflefs.client.bench", "cli_bench"),
}


def default_client_config(args: argparse.Namespace) -> Path:
    """--config, then $SHUFFLEFS_CONFIG, then ./.shufflefs/client.toml."""
    explicit = getattr(args, "config", None)
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return Path(DEFAULT_DATA_DIR) / "client.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shufflefs",
        description="shufflefs: a distributed filesystem for random reads of training data",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def service(name: str, help_: str) -> None:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True, help="the service's TOML config file")

    service("mgmtd", "run the cluster manager")
    service("meta", "run a metadata server")
    service("storage", "run a storage daemon")

    p = sub.add_parser("format", help="create a new cluster's configuration under a data dir")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--storage-nodes", type=int, default=3)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--chunk-size", default="1M", help="default chunk size of new files (e.g. 1M)")
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on")

    p = sub.add_parser("up", help="start a whole cluster on this machine and mount it")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--mountpoint", default=DEFAULT_MOUNTPOINT)
    p.add_argument("--storage-nodes", type=int, default=3)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--chunk-size", default="1M")
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on")
    p.add_argument("--no-mount", action="store_true", help="start the services only")

    p = sub.add_parser("down", help="unmount and stop everything `up` started")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)

    p = sub.add_parser("status", help="nodes, targets, chains and capacity")
    p.add_argument(
        "--config", help="client config (default: $SHUFFLEFS_CONFIG or ./.shufflefs/client.toml)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")

    add_storage_admin_parsers(sub)

    p = sub.add_parser("mount", help="mount the filesystem")
    p.add_argument("mountpoint")
    p.add_argument(
        "--config", help="client config (default: $SHUFFLEFS_CONFIG or ./.shufflefs/client.toml)"
    )
    p.add_argument("--foreground", action="store_true", help="stay in the foreground")
    p.add_argument(
        "--log-file",
        help="log here (default: stderr in the foreground, else a file next to the config)",
    )
    p.add_argument(
        "-o", dest="options", action="append", default=[], help="mount options, comma separated"
    )

    p = sub.add_parser("umount", help="unmount the filesystem")
    p.add_argument("mountpoint")

    add_sample_parser(sub)
    add_bench_parser(sub)
    return parser


def add_sample_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from shufflefs.client.data.cli import add_sample_parser as add  # owned by client/data

    add(sub)


def add_storage_admin_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config_help = "client config (default: $SHUFFLEFS_CONFIG or ./.shufflefs/client.toml)"
    p = sub.add_parser(
        "scrub", help="verify every chunk's checksums and replicas, repair what is damaged"
    )
    p.add_argument("--config", help=config_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("target", help="storage targets (`shufflefs target add`)")
    actions = p.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "add",
        help="format a directory on a storage node as a new target and put it into a chain",
        description="The node formats PATH (on its own host) as a target; mgmtd puts it into "
        "chain C, or the chain with the member offline longest, as syncing; resync brings it "
        "up to date. Without such a chain it stays a spare.",
    )
    a.add_argument("--node", type=int, required=True, help="storage node id (see `status`)")
    a.add_argument("path", help="directory on that node (relative: to the current directory)")
    a.add_argument("--chain", type=int, default=None, help="the chain to join")
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="random-read IOPS four ways in, side by side (`bench loader`: training-data reads)",
        description="Random-read IOPS, MB/s and latency of the same reads through a local file "
        "(the limit), the FUSE mount, the native client and the native client batched; cold "
        "(page caches dropped, as root) and warm. With MODE `loader`: the training-data "
        "benchmark.",
    )
    p.add_argument("--config", help="client config of a running cluster (default: ...)")
    p.add_argument("--mountpoint", help="where that cluster is mounted (for the fuse rows)")
    p.add_argument("--embedded", action="store_true", help="start a cluster, stop it after")
    p.add_argument("--quick", action="store_true", help="a 256 MiB file, 0.4 s per row")
    p.add_argument("--json", action="store_true", help="print one JSON object with `rows`")
    p.add_argument("--readers", type=int, default=8, help="concurrent reader processes (8)")
    p.add_argument("--size-mb", type=int, default=None, help="test file size (1024; quick 256)")
    p.add_argument("--seconds", type=float, default=None, help="seconds per row (5; quick 0.4)")
    p.add_argument("--workloads", help="comma-separated: rand4k,rand2k,rand128k,seq1m")
    p.add_argument("--paths", help="comma-separated: local,fuse,native,native-batch")
    p.add_argument("--batch", type=int, default=64, help="reads per native-batch call (64)")
    p.add_argument("--local-dir", help="where the local copy lives (default: the temp dir)")
    p.add_argument(
        "--no-local-reads",
        action="store_true",
        help="native rows read through the storage daemons even on their own host",
    )
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    modes.required = False
    b = modes.add_parser(
        "loader",
        help="shuffled token windows per second: local disk, FUSE, native; with readahead",
        description="Sweep the batch size at a fixed seq_len and report tokens/s, samples/s "
        "and p99 batch latency for a local copy, the FUSE mount (plain reads) and the native "
        "client without and with readahead along the shuffle; cold (page caches dropped, as "
        "root) and warm.",
    )
    b.add_argument(
        "--config", help="client config of a running cluster (default: $SHUFFLEFS_CONFIG ...)"
    )
    b.add_argument("--mountpoint", help="where that cluster is mounted (for the FUSE rows)")
    b.add_argument(
        "--embedded", action="store_true", help="start a cluster in a temp dir, stop it after"
    )
    b.add_argument("--local-dir", help="where the local copy lives (default: a temp dir)")
    b.add_argument("--remote-dir", default="/bench-loader", help="dataset folder on the cluster")
    b.add_argument("--dataset-size", default="2G", help="total size of the token files (2G)")
    b.add_argument("--files", type=int, default=8, help="number of token files")
    b.add_argument("--seq-len", type=int, default=1024)
    b.add_argument("--dtype", default="uint16")
    b.add_argument("--batch-sizes", default="8,32,128,512,2048,4096", help="comma-separated sweep")
    b.add_argument("--readahead", type=int, default=4, help="batches in flight (readahead rows)")
    b.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    b.add_argument(
        "--configs",
        default="local,local+ra,fuse,fuse+ra,native,native+ra",
        help="which rows: local, local+ra, fuse, fuse+ra, native, native+ra",
    )
    b.add_argument("--no-cold", action="store_true", help="skip the cold-cache pass")
    b.add_argument("--no-warm", action="store_true", help="skip the warm-cache pass")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--plot", metavar="FILE.png", help="draw tokens/s against batch size")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module_name, func_name = COMMANDS[args.command]
    try:
        func: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module_name), func_name
        )
        return func(args)
    except FsError as exc:
        print(f"shufflefs {args.command}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `shufflefs status | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
