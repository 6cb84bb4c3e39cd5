"""``shufflefs sample explain``: which bytes did step K read?

When a run dies or a loss spikes at some step, the samples of that step are
the first suspects (a "record of death"). The order is a pure function of
(seed, epoch, position), so the samples of any step can be named afterwards
from the dataset's description alone, without the run's state:

    shufflefs sample explain --seed 0 --epoch 3 --step 1234 --batch-size 32 \\
        --seq-len 1024 --dtype uint16 --world-size 8 data/train-*.bin

prints, for every sample of global step 1234 (each rank's batch 1234), the
rank, its position in the rank's order, the window number, and the file,
byte offset and byte length to replay it (``--rank R`` for one rank only,
``--json`` for scripts, ``--files`` for one-sample-per-file datasets).

``--mixture run.toml`` names the samples of a mixture (see `config`) instead:
component, path, byte offset and length of each, quarantined ones marked.
Its global step ``k`` counts from ``--start``, the position the run (or its
last resume) began at; with the run's global batch fixed that is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from shufflefs.client.data.files import FileSamples
from shufflefs.client.data.tokens import ExplainedSample, TokenWindows


def explain_step(args: argparse.Namespace) -> list[ExplainedSample]:
    rank = args.rank if args.rank is not None else 0
    common = dict(
        seed=args.seed,
        rank=rank,
        world_size=args.world_size,
        drop_last=args.drop_last,
        config=args.config,
    )
    dataset: FileSamples | TokenWindows
    if args.files:
        dataset = FileSamples(args.paths, **common)
    else:
        dataset = TokenWindows(
            args.paths, seq_len=args.seq_len, dtype=args.dtype, stride=args.stride, **common
        )
    if args.rank is not None:
        return dataset._explain_rank(rank, args.step * args.batch_size, args.batch_size, args.epoch)
    return dataset.explain_step(args.step, args.batch_size, args.epoch)


def explain_mixture_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    from shufflefs.client.data.config import load_mixture

    mix = load_mixture(args.mixture, 0, args.world_size, batch_size=args.batch_size, torch=False)
    mix.set_epoch(args.epoch)
    mix.shard = dataclasses.replace(mix.shard, start=args.start)
    rows = mix.explain_step(args.step, args.batch_size, args.epoch)
    return [r for r in rows if args.rank is None or r["rank"] == args.rank]


def print_mixture_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(
        f"step {args.step} of epoch {args.epoch} from position {args.start}: {len(rows)} "
        f"samples, batch size {args.batch_size} per rank, world size {args.world_size}"
    )
    table = [("rank", "position", "component", "offset", "length", "path")]
    table += [
        (
            str(r["rank"]),
            str(r["position"]),
            str(r["component"]),
            str(r["offset"]),
            str(r["length"]),
            r["path"] + ("  (quarantined)" if r.get("quarantined") else ""),
        )
        for r in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        print("  ".join(c.rjust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])


def cli_sample(args: argparse.Namespace) -> int:
    if args.sample_command == "quarantine":
        from shufflefs.client.data.quarantine import cli_quarantine

        return cli_quarantine(args)
    if args.sample_command == "startup":
        from shufflefs.client.data.startup import cli_startup

        return cli_startup(args)
    if args.sample_command != "explain":
        print(f"shufflefs sample: unknown subcommand {args.sample_command!r}", file=sys.stderr)
        return 2
    if args.mixture is None and (not args.paths or args.seed is None):
        print("shufflefs sample explain: give PATHs and --seed, or --mixture", file=sys.stderr)
        return 2
    for name in ("batch_size", "world_size"):
        if getattr(args, name) < 1:
            print(
                f"shufflefs sample explain: --{name.replace('_', '-')} must be >= 1",
                file=sys.stderr,
            )
            return 2
    if args.step < 0 or args.epoch < 0:
        print("shufflefs sample explain: --step and --epoch must be >= 0", file=sys.stderr)
        return 2
    try:
        if args.mixture is not None:
            mixed = explain_mixture_step(args)
        else:
            samples = explain_step(args)
    except OSError as exc:
        from shufflefs.cluster.cli_errors import describe_os_error

        print(f"shufflefs sample explain: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    except (ValueError, IndexError) as exc:
        print(f"shufflefs sample explain: {exc}", file=sys.stderr)
        return 1
    if args.mixture is not None:
        if args.json:
            keys = ("step", "epoch", "start", "batch_size", "world_size")
            print(json.dumps({**{k: getattr(args, k) for k in keys}, "samples": mixed}, indent=2))
        else:
            print_mixture_rows(args, mixed)
        return 0
    if args.json:
        out: dict[str, Any] = {
            "seed": args.seed,
            "epoch": args.epoch,
            "step": args.step,
            "batch_size": args.batch_size,
            "world_size": args.world_size,
            "samples": [dataclasses.asdict(s) for s in samples],
        }
        print(json.dumps(out, indent=2))
        return 0
    item = "file" if args.files else "window"
    print(
        f"step {args.step} of epoch {args.epoch} (seed {args.seed}): {len(samples)} samples, "
        f"batch size {args.batch_size} per rank, world size {args.world_size}"
    )
    rows = [("rank", "position", item, "byte_offset", "byte_length", "path")]
    rows += [
        (str(s.rank), str(s.position), str(s.item), str(s.byte_offset), str(s.byte_length), s.path)
        for s in samples
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    return 0
