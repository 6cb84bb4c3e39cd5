"""The ``shufflefs sample`` subcommands' arguments (the commands run in
`explain`, `quarantine` and `startup`). Values are checked as the rest of
the CLI checks them (`cluster/preflight.py`): a mistake is one line and exit
code 2, before anything runs."""

from __future__ import annotations

import argparse

from shufflefs.cluster.preflight import TOKEN_DTYPES, nonnegative_int, positive_int

CONFIG_HELP = (
    "client config for shufflefs:// paths "
    "(default: $SHUFFLEFS_CONFIG, else ./.shufflefs/client.toml)"
)


def add_sample_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sample", help="the training-data sampler: name, quarantine and time the samples of a run"
    )
    modes = p.add_subparsers(dest="sample_command", metavar="SUBCOMMAND", required=True)
    e = modes.add_parser(
        "explain",
        help="print file, byte offset and length of every sample of a global step",
        description="Name every sample of a global step (each rank's batch STEP), so a "
        "record that broke a run can be found and replayed. With --mixture, the samples "
        "of a mixture (component, path, offset, length; quarantined ones marked).",
    )
    e.add_argument("paths", nargs="*", metavar="PATH", help="the dataset's files or URLs")
    e.add_argument(
        "--mixture", metavar="RUN.toml", help="a mixture config instead of PATHs (default: none)"
    )
    e.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the run's seed (default: none; required without --mixture)",
    )
    e.add_argument("--epoch", type=nonnegative_int, required=True, help="the epoch")
    e.add_argument(
        "--step", type=nonnegative_int, required=True, help="global step (each rank's batch K)"
    )
    e.add_argument("--batch-size", type=positive_int, required=True, help="per-rank batch size")
    e.add_argument(
        "--start",
        type=nonnegative_int,
        default=0,
        help="mixtures: the global position the run (or its last resume) began at; "
        "STEP counts from there (default: 0)",
    )
    e.add_argument(
        "--seq-len", type=positive_int, default=1024, help="tokens per window (default: 1024)"
    )
    e.add_argument(
        "--dtype", choices=TOKEN_DTYPES, help="token dtype of .bin files (default: uint16)"
    )
    e.add_argument(
        "--stride", type=positive_int, default=None, help="window stride (default: seq-len)"
    )
    e.add_argument(
        "--rank", type=nonnegative_int, help="only this rank's samples (default: every rank)"
    )
    e.add_argument(
        "--world-size", type=positive_int, default=1, help="ranks in the run (default: 1)"
    )
    e.add_argument("--drop-last", action="store_true", help="the run used drop_last")
    e.add_argument("--files", action="store_true", help="one sample per file (FileDataset)")
    e.add_argument("--config", help=CONFIG_HELP)
    e.add_argument("--json", action="store_true", help="print one JSON object")

    q = modes.add_parser(
        "quarantine",
        help="add or remove samples of a run's quarantine file (skipped by every later run)",
        description="Keys are COMPONENT:PATH:OFFSET:LENGTH (or JSON objects) as `sample "
        "explain` names them; with --mixture they are checked against it, and the file is "
        "the one the mixture config names (or --file).",
    )
    q.add_argument("--mixture", metavar="RUN.toml", help="the run's mixture config (default: none)")
    q.add_argument("--file", help="the quarantine file (default: the mixture config's)")
    q.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="KEY",
        help="quarantine KEY (repeatable; default: none)",
    )
    q.add_argument(
        "--remove",
        action="append",
        default=[],
        metavar="KEY",
        help="release KEY (repeatable; default: none)",
    )
    q.add_argument(
        "--from",
        dest="from_explain",
        metavar="EXPLAIN.json",
        help="every sample of a report (default: none)",
    )
    q.add_argument(
        "--rank", type=nonnegative_int, help="with --from: only this rank's (default: every rank)"
    )
    q.add_argument("--config", help=CONFIG_HELP)
    q.add_argument("--json", action="store_true", help="print one JSON object")

    s = modes.add_parser(
        "startup",
        help="time to the first batch and memory of the order at 1e6, 1e9, 1e12 samples",
        description="Builds index spaces of each size (sparse token files: no data is "
        "needed for the order) and a 3-component mixture of them, and reports the time "
        "to the first batch and the memory it took, each in a fresh process.",
    )
    s.add_argument("--sizes", default="1e6,1e9,1e12", help="comma-separated sample counts")
    s.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        help="samples in the first batch (default: 32)",
    )
    s.add_argument("--dir", help="where the sparse files go (default: a temp dir)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
