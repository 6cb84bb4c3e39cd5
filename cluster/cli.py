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
    "mount": ("shufflefs.fuse.mount", "cli_mount"),
    "umount": ("shufflefs.fuse.mount", "cli_umount"),
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
    return parser


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
