"""Quarantine files and ``shufflefs sample quarantine``.

A quarantine is a list of sample keys ``{"component", "path", "offset",
"length"}`` as `explain` names them (``component`` only for mixtures). It is
kept in a small JSON file next to the run's mixture config, so a bad record
found after a crash is skipped by every later run, and by any resume of it:

    shufflefs sample explain --mixture run.toml --step 1234 --batch-size 8 \\
        --world-size 64 --json > step1234.json
    shufflefs sample quarantine --mixture run.toml --add 0:/data/web/07.bin:81920:4098
    shufflefs sample quarantine --mixture run.toml --from step1234.json --rank 17

Keys are checked against the mixture (a key that names no sample is refused)
before the file is written, atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shufflefs.client.data.state import as_key
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import read_json, write_json_durably

FORMAT = "shufflefs.quarantine/1"


def read_quarantine(path: Path) -> list[dict[str, Any]]:
    data = read_json(path)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a quarantine file")
    return [as_key(k) for k in data["keys"]]


def write_quarantine(path: Path, keys: list[dict[str, Any]]) -> None:
    write_json_durably(path, {"format": FORMAT, "keys": keys})


def parse_key(text: str) -> dict[str, Any]:
    """A key from the command line: a JSON object, or
    ``COMPONENT:PATH:OFFSET:LENGTH`` (a path may hold colons)."""
    if text.lstrip().startswith("{"):
        return as_key(json.loads(text))
    head, _, rest = text.partition(":")
    path, _, tail = rest.rpartition(":")
    path, _, offset = path.rpartition(":")
    if not head or not path:
        raise ValueError(f"{text!r}: a key is COMPONENT:PATH:OFFSET:LENGTH or a JSON object")
    return as_key([int(head), path, int(offset), int(tail)])


def keys_from_explain(path: Path, rank: int | None) -> list[dict[str, Any]]:
    """The samples of a ``shufflefs sample explain --json`` report (of one rank)."""
    data = json.loads(path.read_text())
    rows = data["samples"] if isinstance(data, dict) else data
    return [as_key(r) for r in rows if rank is None or r.get("rank") == rank]


def cli_quarantine(args: argparse.Namespace) -> int:
    from shufflefs.client.data.config import load_mixture, quarantine_path
    from shufflefs.cluster.cli_errors import describe_os_error

    where = "shufflefs sample quarantine"
    if not args.file and not args.mixture:
        print(f"{where}: give --mixture RUN.toml or --file QUARANTINE.json", file=sys.stderr)
        return 2
    if args.config is not None and not Path(args.config).is_file():
        print(f"{where}: --config {args.config}: no such file", file=sys.stderr)
        return 2
    try:
        target = Path(args.file) if args.file else quarantine_path(args.mixture)
        if target is not None and not target.parent.is_dir():
            print(f"{where}: --file {target}: {target.parent} is not a directory", file=sys.stderr)
            return 2
        if target is None:
            print(f"{where}: {args.mixture} names no quarantine file; give --file", file=sys.stderr)
            return 2
        keys = read_quarantine(target) if target.exists() else []
        added = [parse_key(k) for k in args.add]
        if args.from_explain:
            added += keys_from_explain(Path(args.from_explain), args.rank)
        removed = {json.dumps(parse_key(k), sort_keys=True) for k in args.remove}
        kept = [k for k in keys if json.dumps(k, sort_keys=True) not in removed]
        have = {json.dumps(k, sort_keys=True) for k in kept}
        new = [k for k in added if json.dumps(k, sort_keys=True) not in have]
        if args.mixture:
            load_mixture(args.mixture, config=args.config, torch=False).quarantine(
                kept + new
            )  # checks keys
        if added or removed:
            write_quarantine(target, kept + new)
    except (ValueError, OSError, KeyError, FsError) as exc:
        if isinstance(exc, FsError):
            msg = exc.message
        elif isinstance(exc, OSError):
            msg = describe_os_error(exc)
        else:
            msg = str(exc)
        print(f"{where}: {msg}", file=sys.stderr)
        return 1
    total = kept + new
    if args.json:
        print(json.dumps({"file": str(target), "keys": total}, indent=2))
    else:
        gone = len(keys) - len(kept)
        print(f"{target}: {len(total)} quarantined ({len(new)} added, {gone} removed)")
        for k in total:
            c = f"{k['component']}:" if "component" in k else ""
            print(f"  {c}{k['path']}:{k['offset']}:{k['length']}")
    return 0
