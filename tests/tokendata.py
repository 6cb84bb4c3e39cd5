"""Token datasets for the sampler tests, built so every window is recognisable.

Token values are a running counter over all files (uint32), so a window's
first token says which file and offset it came from; the tests check
coverage and byte-exactness against this, independently of the sampler's own
bookkeeping. `shufflefs_cli` runs the command the sampler tests drive.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

# file name -> number of tokens; the .npy files exercise headers, the short
# one has no window at seq_len 64, the primes make odd window counts
DEFAULT_FILES = {"a.bin": 5003, "b.npy": 3001, "c.bin": 40, "d.npy": 7919}


def write_tokens(
    directory: Path,
    files: dict[str, int] | None = None,
    dtype: str = "uint32",
    npy_version: tuple[int, int] = (1, 0),
) -> list[str]:
    """Write the files (counter tokens) and return their paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    base = 0
    for name, n in (files or DEFAULT_FILES).items():
        data = (np.arange(n, dtype=np.int64) + base).astype(dtype)
        base += n
        path = directory / name
        if name.endswith(".npy"):
            with open(path, "wb") as f:
                np.lib.format.write_array(f, data, version=npy_version)
        else:
            data.tofile(path)
        paths.append(str(path))
    return paths


def window_starts(files: dict[str, int], seq_len: int, stride: int) -> list[int]:
    """First token value of every window of the dataset, computed from the
    definition (windows of seq_len + 1 tokens every stride tokens, inside one
    file)."""
    starts = []
    base = 0
    for n in files.values():
        starts.extend(base + s for s in range(0, n - seq_len, stride))
        base += n
    return starts


def shufflefs_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``shufflefs ARGS...`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
