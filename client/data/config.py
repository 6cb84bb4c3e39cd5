"""A training mixture described in a TOML file, so a run and the shell agree.

The training script builds its `Mixture` with `load_mixture`, and ``shufflefs
sample explain --mixture`` / ``shufflefs sample quarantine --mixture`` read
the same file; docs/training-data.md shows a full pretraining example:

    seed = 0
    seq_len = 2048
    dtype = "uint16"
    global_batch_size = 1024          # turns schedule steps into sample positions
    exhausted = "repeat"              # or "stop"
    samples_per_epoch = 1_000_000_000
    quarantine = "quarantine.json"    # optional; relative to this file

    [[source]]
    name = "web"
    paths = ["/data/web/*.bin"]       # local globs are expanded; URLs taken as given

    [[source]]
    name = "images"
    files = true                      # one sample per file
    paths = ["shufflefs:///img/train"]

    [[schedule]]                      # or: weights = [...] for a constant mix
    step = 0
    weights = [0.9, 0.1]

A source may set its own ``seq_len``, ``dtype``, ``stride``, ``suffixes``.
Schedule pieces take ``step`` (times ``global_batch_size``) or ``position``.
"""

from __future__ import annotations

import glob
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shufflefs.client.data.quarantine import read_quarantine
from shufflefs.client.data.urls import is_url

if TYPE_CHECKING:
    from shufflefs.client.data.files import FileSamples
    from shufflefs.client.data.mixture import MixtureSamples
    from shufflefs.client.data.tokens import TokenWindows

SOURCE_KEYS = {"name", "paths", "files", "seq_len", "dtype", "stride", "suffixes"}
TOP_KEYS = {
    "seed",
    "seq_len",
    "dtype",
    "stride",
    "global_batch_size",
    "exhausted",
    "samples_per_epoch",
    "quarantine",
    "source",
    "schedule",
    "weights",
    "drop_last",
}


def read_mixture_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            cfg = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    unknown = set(cfg) - TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if not cfg.get("source"):
        raise ValueError(f"{path}: no [[source]]")
    for i, src in enumerate(cfg["source"]):
        bad = set(src) - SOURCE_KEYS
        if bad:
            raise ValueError(f"{path}: source {i}: unknown keys {sorted(bad)}")
        if not src.get("paths"):
            raise ValueError(f"{path}: source {i} has no paths")
    return cfg


def expand(paths: list[str], base: Path) -> list[str]:
    out: list[str] = []
    for p in paths:
        if is_url(p):
            out.append(p)
            continue
        full = p if os.path.isabs(p) else str(base / p)
        found = sorted(glob.glob(full)) if glob.has_magic(full) else [full]
        if not found:
            raise ValueError(f"{p}: no such files")
        out += found
    return out


def schedule_of(cfg: dict[str, Any], where: str) -> list[tuple[int, list[float]]]:
    if ("weights" in cfg) == ("schedule" in cfg):
        raise ValueError(f"{where}: give weights = [...] or [[schedule]] pieces (one of them)")
    if "weights" in cfg:
        return [(0, list(cfg["weights"]))]
    pieces = []
    for piece in cfg["schedule"]:
        if "position" in piece:
            at = int(piece["position"])
        elif "step" in piece:
            if "global_batch_size" not in cfg:
                raise ValueError(f"{where}: schedule steps need global_batch_size")
            at = int(piece["step"]) * int(cfg["global_batch_size"])
        else:
            raise ValueError(f"{where}: a schedule piece needs step or position")
        pieces.append((at, list(piece["weights"])))
    return pieces


def load_mixture(
    path: str | os.PathLike[str],
    rank: int = 0,
    world_size: int = 1,
    *,
    batch_size: int | None = None,
    config: str | os.PathLike[str] | None = None,
    readahead: int = 4,
    torch: bool = True,
) -> MixtureSamples:
    """The mixture *path* describes, for this rank (with its quarantine file,
    if it names one and the file exists): a `Mixture` of torch datasets, or
    with ``torch=False`` the same order over the plain classes (what the CLI
    needs to name samples: importing torch takes seconds)."""
    cfg = read_mixture_config(path)
    Files: type[FileSamples]
    Tokens: type[TokenWindows]
    Mix: type[MixtureSamples]
    if torch:
        from shufflefs.client.data.datasets import FileDataset, Mixture, TokenWindowDataset

        Files, Tokens, Mix = FileDataset, TokenWindowDataset, Mixture
    else:
        from shufflefs.client.data.files import FileSamples
        from shufflefs.client.data.mixture import MixtureSamples
        from shufflefs.client.data.tokens import TokenWindows

        Files, Tokens, Mix = FileSamples, TokenWindows, MixtureSamples

    base = Path(path).parent
    parts: list[Any] = []
    for src in cfg["source"]:
        paths = expand(list(src["paths"]), base)
        if src.get("files"):
            parts.append(Files(paths, config=config, suffixes=src.get("suffixes")))
        else:
            parts.append(
                Tokens(
                    paths,
                    seq_len=int(src.get("seq_len", cfg.get("seq_len", 1024))),
                    dtype=src.get("dtype", cfg.get("dtype")),
                    stride=src.get("stride", cfg.get("stride")),
                    config=config,
                )
            )
    mix = Mix(
        parts,
        schedule=schedule_of(cfg, str(path)),
        seed=int(cfg.get("seed", 0)),
        rank=rank,
        world_size=world_size,
        exhausted=cfg.get("exhausted", "stop"),
        samples_per_epoch=cfg.get("samples_per_epoch"),
        batch_size=batch_size,
        readahead=readahead,
        drop_last=bool(cfg.get("drop_last", False)),
    )
    qfile = cfg.get("quarantine")
    if qfile is not None:
        qpath = Path(qfile) if os.path.isabs(qfile) else base / qfile
        if qpath.exists():
            mix.quarantine(read_quarantine(qpath))
    return mix


def quarantine_path(path: str | os.PathLike[str]) -> Path | None:
    """The quarantine file a mixture config names (None: it names none)."""
    qfile = read_mixture_config(path).get("quarantine")
    if qfile is None:
        return None
    return Path(qfile) if os.path.isabs(qfile) else Path(path).parent / qfile
