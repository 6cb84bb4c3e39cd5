"""The ``shufflefs`` command.

User mistakes (a bad flag, a missing config, an unreachable cluster) end with
one line on stderr and a non-zero exit code that says what kind of failure it
was, never a traceback (`cli_errors`); arguments and configs are checked
before a command acts (`preflight`). Service subcommands import their
component lazily, so ``shufflefs status`` does not load pyfuse3 and
``shufflefs storage`` does not load the metadata server.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from shufflefs.cluster.cli_bench import CONFIG_HELP, add_bench_parser
from shufflefs.cluster.cli_errors import Parser, exit_codes_epilog, run_reporting
from shufflefs.cluster.config import DEFAULT_DATA_DIR
from shufflefs.cluster.preflight import (
    check_arguments,
    int_in,
    positive_float,
    positive_int,
    size,
)
from shufflefs.rpc import framing

# `shufflefs import`: files in flight (each holds up to 4 MiB of its bytes while in flight);
# client/ingest.py's DEFAULT_CONCURRENCY, not imported: the parser stays light
DEFAULT_IMPORT_CONCURRENCY = 256
MAX_IMPORT_CONCURRENCY = 256

DEFAULT_MOUNTPOINT = "mnt"
MAX_LOCAL_STORAGE_NODES = 64
MAX_TARGETS_PER_NODE = 64

# subcommand -> (module, function taking the parsed args and returning an exit code)
COMMANDS: dict[str, tuple[str, str]] = {
    "mgmtd": ("shufflefs.cluster.mgmtd", "cli_main"),
    "meta": ("shufflefs.metadata.process", "cli_main"),
    "storage": ("shufflefs.storage.daemon", "cli_main"),
    "up": ("shufflefs.cluster.lifecycle", "cli_up"),
    "down": ("shufflefs.cluster.lifecycle", "cli_down"),
    "format": ("shufflefs.cluster.lifecycle", "cli_format"),
    "status": ("shufflefs.cluster.admin", "cli_status"),
    "scrub": ("shufflefs.cluster.scrub", "cli_scrub"),
    "fsck": ("shufflefs.cluster.fsck", "cli_fsck"),
    "target": ("shufflefs.cluster.targets", "cli_target"),
    "node": ("shufflefs.cluster.nodes", "cli_node"),
    "rebalance": ("shufflefs.cluster.cli_jobs", "cli_rebalance"),
    "jobs": ("shufflefs.cluster.cli_jobs", "cli_jobs"),
    "mount": ("shufflefs.fuse.mount", "cli_mount"),
    "umount": ("shufflefs.fuse.mount", "cli_umount"),
    "sample": ("shufflefs.client.data.explain", "cli_sample"),
    "bench": ("shufflefs.client.bench", "cli_bench"),
    "df": ("shufflefs.cluster.cli_df", "cli_df"),
    "info": ("shufflefs.cluster.cli_info", "cli_info"),
    "warmup": ("shufflefs.cluster.cli_warmup", "cli_warmup"),
    "import": ("shufflefs.cluster.cli_import", "cli_import"),
    "top": ("shufflefs.cluster.cli_top", "cli_top"),
}


def version_text() -> str:
    import importlib.metadata  # 50 ms: only for --version

    try:
        version = importlib.metadata.version("shufflefs")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"shufflefs {version} (wire protocol {framing.VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="shufflefs",
        description="shufflefs: a distributed filesystem for random reads of training data",
        epilog=exit_codes_epilog(),
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def service(name: str, help_: str) -> None:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True, help="the service's TOML config file")

    service("mgmtd", "run the cluster manager")
    p = sub.add_parser(
        "meta",
        help="run a metadata server (--config), or `meta add`: one more in a local group",
    )
    p.add_argument(
        "--config", help="the service's TOML config file, to run a server (default: none)"
    )
    actions = p.add_subparsers(dest="meta_command", metavar="ACTION")
    a = actions.add_parser(
        "add",
        help="add a metadata server to a local cluster's group and wait until it caught up",
        description="Writes its config (and the others' group_size), starts it, and waits "
        "until it follows the primary with the primary's log position (it copies a snapshot "
        "of the namespace first). On a real cluster, start a metadata server on the new host "
        "instead: it registers and the group counts it.",
    )
    a.add_argument(
        "--data-dir", default=DEFAULT_DATA_DIR, help="the local cluster (default: %(default)s)"
    )
    a.add_argument("--timeout", type=positive_float, default=120.0, help="seconds to wait at most")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    service("storage", "run a storage daemon")

    nodes_type = int_in(1, MAX_LOCAL_STORAGE_NODES)
    p = sub.add_parser("format", help="create a new cluster's configuration under a data dir")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the cluster lives")
    p.add_argument("--storage-nodes", type=nodes_type, default=3, help="storage daemons")
    p.add_argument(
        "--replicas",
        type=positive_int,
        help="copies of each chunk (default: 3 if 3+ nodes, else 1)",
    )
    p.add_argument("--chunk-size", type=size, default="1M", help="chunk size of new files")
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on")
    p.add_argument(
        "--targets-per-node",
        type=int_in(1, MAX_TARGETS_PER_NODE),
        default=1,
        help="target directories per storage node (a disk each on a real node)",
    )

    p = sub.add_parser(
        "up",
        help="start a whole cluster on this machine and mount it",
        description="Format DATA_DIR on first use, start every service that is not running, "
        "wait until each is ready, and mount. On an existing cluster --storage-nodes N adds "
        "nodes up to N; the other shape options must match what it was formatted with.",
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the cluster lives")
    p.add_argument("--mountpoint", default=DEFAULT_MOUNTPOINT, help="where to mount it")
    p.add_argument(
        "--storage-nodes",
        type=nodes_type,
        help="storage daemons (default: 3 for a new cluster, else as it is)",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        help="copies of each chunk, fixed at format (default: 3 if 3+ nodes, else 1)",
    )
    p.add_argument(
        "--chunk-size", type=size, help="chunk size of new files (default: 1M for a new cluster)"
    )
    p.add_argument(
        "--host", help="address the services listen on (default: 127.0.0.1 for a new cluster)"
    )
    p.add_argument(
        "--meta-servers",
        type=positive_int,
        help="metadata servers, fixed at format (default: 1; 3 for failover)",
    )
    p.add_argument(
        "--targets-per-node",
        type=int_in(1, MAX_TARGETS_PER_NODE),
        help="target directories per storage node, fixed at format (default: 1); chains "
        "spread over them so a dead node is recovered from many others",
    )
    p.add_argument(
        "--ha",
        action="store_true",
        help="no single point of failure, fixed at format: 3 mgmtd on a local 3-member etcd "
        "cluster and 3 metadata servers (needs etcd, Debian package etcd-server)",
    )
    p.add_argument("--no-mount", action="store_true", help="start the services only")

    p = sub.add_parser("down", help="unmount and stop what `up` started and the other mounts")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="the cluster to stop")

    p = sub.add_parser("status", help="nodes, targets, chains and capacity")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    add_storage_admin_parsers(sub)

    p = sub.add_parser("mount", help="mount the filesystem")
    p.add_argument("mountpoint", help="an existing directory")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--foreground", action="store_true", help="stay in the foreground")
    p.add_argument(
        "--log-file",
        help="log here (default: stderr in the foreground, else a file next to the config)",
    )
    p.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        help="mount options, comma separated (default: none; see docs/operations.md)",
    )

    p = sub.add_parser("umount", help="unmount the filesystem")
    p.add_argument("mountpoint", help="where shufflefs is mounted")

    add_sample_parser(sub)
    add_bench_parser(sub)
    add_ops_parsers(sub)
    return parser


def add_ops_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("df", help="capacity, used and free space per target, per node, in total")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "info",
        help="a file's inode, layout, chains and where each chunk's replicas are",
        description="PATH is a path on a shufflefs mount of this machine or inside the cluster "
        "(/dir/file). For a file: its layout and, for the first --chunks chunks, every replica "
        "with its target's state and what that storage daemon holds.",
    )
    p.add_argument("path", help="a path on a mount, or inside the cluster")
    p.add_argument(
        "--chunks", type=positive_int, default=16, help="chunks to list with their replicas"
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "warmup",
        help="read files once so the storage hosts' page caches hold them",
        description="Reads every file under the PATHs (paths on a mount or inside the "
        "cluster; directories are walked) once, whole; a progress bar on a terminal.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    p.add_argument(
        "--concurrency", type=positive_int, default=8, help="4 MiB reads in flight at once"
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object with the totals")

    p = sub.add_parser(
        "import",
        help="copy a local directory tree (a dataset) into the cluster, many files at once",
        description="Copies SOURCE into the cluster: a directory's contents go into DEST "
        "(made, with missing parents, if need be), a file to DEST (or into it, if DEST is a "
        "directory). DEST is a path on a shufflefs mount of this machine or inside the "
        "cluster. Permission bits are kept; links are copied as links; other special "
        "files are left out and named. Exit 1 if any file failed.",
    )
    p.add_argument("source", metavar="SOURCE", help="a local directory or file")
    p.add_argument("dest", metavar="DEST", help="where it goes, on a mount or in the cluster")
    p.add_argument(
        "--concurrency",
        type=int_in(1, MAX_IMPORT_CONCURRENCY),
        default=DEFAULT_IMPORT_CONCURRENCY,
        help="files in flight at once",
    )
    p.add_argument(
        "--skip-existing",
        action="store_true",
        help="leave files already there with their source's size (finish a run that stopped)",
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object with the totals")

    p = sub.add_parser(
        "top",
        help="live IOPS, throughput and latency per node and per mount (from the metrics)",
    )
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--count", type=positive_int, help="stop after this many refreshes (default: never)"
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object per refresh")


def add_sample_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from shufflefs.client.data.cli import add_sample_parser as add  # owned by client/data

    add(sub)


def add_storage_admin_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config_help = CONFIG_HELP
    p = sub.add_parser(
        "scrub", help="verify every chunk's checksums and replicas, repair what is damaged"
    )
    p.add_argument("--config", help=config_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "fsck",
        help="check the namespace against the chunks on every storage target",
        description="Report orphan chunks (no file accounts for them), missing and "
        "under-replicated chunks, and chunks longer than their file; --repair removes "
        "orphans and re-copies under-replicated chunks from the chain's head. Exit 1 if "
        "problems remain. Run it while no writes are in flight.",
    )
    p.add_argument("--config", help=config_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repair", action="store_true", help="fix what can be fixed, then check again")

    p = sub.add_parser("target", help="storage targets (`shufflefs target add`)")
    actions = p.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "add",
        help="format a directory on a storage node as a new target and put it into a chain",
        description="The node formats PATH (on its own host) as a target; mgmtd puts it into "
        "chain C, or the chain with the member offline longest, as syncing; resync brings it "
        "up to date. Without such a chain it stays a spare.",
    )
    a.add_argument(
        "--node", type=positive_int, required=True, help="storage node id (see `status`)"
    )
    a.add_argument("path", help="directory on that node (relative: to the current directory)")
    a.add_argument(
        "--chain",
        type=positive_int,
        help="the chain to join (default: the one whose member is offline longest)",
    )
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a = actions.add_parser(
        "remove",
        help="forget a target that is in no chain (a spare, or one drained)",
        description="Refused while the target is a member of a chain: drain its node first.",
    )
    a.add_argument("id", type=positive_int, help="target id (see `status`)")
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("node", help="storage nodes (`shufflefs node drain|remove ID`)")
    actions = p.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "drain",
        help="move every replica off a storage node while it keeps serving",
        description="mgmtd puts a spare target of another node into each chain of the node, "
        "resync copies the chain to it, then the node's target leaves the chain; one chain at "
        "a time. Refused when a chain has no spare target to move to. Resumes by itself "
        "after restarts.",
    )
    a.add_argument("id", type=positive_int, help="storage node id (see `status`)")
    a.add_argument("--wait", action="store_true", help="wait until the node is in no chain")
    a.add_argument(
        "--timeout", type=positive_float, default=3600.0, help="seconds --wait waits at most"
    )
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a = actions.add_parser(
        "remove",
        help="take a drained storage node out of the cluster",
        description="Refused while the node still holds replicas: drain it first.",
    )
    a.add_argument("id", type=positive_int, help="storage node id (see `status`)")
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    add_jobs_parsers(sub, config_help)


def job_id(text: str) -> str:
    """A cancellable job's id: drain-NODE, replace-NODE or rebalance-N (`shufflefs jobs`)."""
    kind, _, number = text.partition("-")
    if kind not in ("drain", "replace", "rebalance") or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a cancellable job id: drain-NODE, replace-NODE or rebalance-N "
            "(`shufflefs jobs`)"
        )
    return f"{kind}-{int(number)}"


def add_jobs_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], config_help: str
) -> None:
    p = sub.add_parser(
        "rebalance",
        help="move chain memberships onto nodes or targets added since, to even out usage",
        description="mgmtd moves a member target of the most-used node to a spare target of "
        "the least-used node that has none in that chain (by used bytes, else by chain "
        "counts), one move at a time: the spare joins as syncing, resync copies the chain, "
        "then the old member leaves. Refused while a drain runs or when nothing would move. "
        "Resumes by itself after restarts; `shufflefs jobs cancel` stops it.",
    )
    p.add_argument("--wait", action="store_true", help="wait until the rebalance is done")
    p.add_argument(
        "--timeout", type=positive_float, default=3600.0, help="seconds --wait waits at most"
    )
    p.add_argument("--config", help=config_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser(
        "jobs",
        help="mgmtd's background jobs: drains, the rebalance, resyncs (`jobs cancel ID`)",
        description="Lists the running drains (chains left), the rebalance (moves done and "
        "left; also once it has ended) and the resyncs of syncing targets.",
    )
    p.add_argument("--config", help=config_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    actions = p.add_subparsers(dest="jobs_command", metavar="ACTION")
    a = actions.add_parser(
        "cancel",
        help="cancel a drain, a re-replication or the rebalance",
        description="No new moves start; the move in flight is rolled back (its newcomer has "
        "not served yet, so the chain is as it was), or completed if the newcomer already "
        "serves. A resync cannot be cancelled.",
    )
    a.add_argument(
        "id", type=job_id, help="drain-NODE, replace-NODE or rebalance-N (see `shufflefs jobs`)"
    )
    a.add_argument("--config", help=config_help)
    a.add_argument("--json", action="store_true", help="print one JSON object")


def command_label(args: argparse.Namespace) -> str:
    """'shufflefs target add': the words that name what failed."""
    words = ["shufflefs", args.command]
    for action in (
        "target_command",
        "node_command",
        "meta_command",
        "jobs_command",
        "sample_command",
        "bench_mode",
    ):
        if getattr(args, action, None):
            words.append(getattr(args, action))
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module_name, func_name = COMMANDS[args.command]
    if args.command == "meta":
        if getattr(args, "meta_command", None) == "add":
            module_name, func_name = "shufflefs.cluster.meta_add", "cli_meta_add"
        elif not args.config:
            parser.error("meta: --config is required to run a metadata server (or: meta add)")

    def run() -> int:
        check_arguments(args)
        func: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module_name), func_name
        )
        return func(args)

    return run_reporting(command_label(args), args, run)


if __name__ == "__main__":
    sys.exit(main())
