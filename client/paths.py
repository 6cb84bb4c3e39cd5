"""Path helpers of the native API (`FileSystem.resolve` and the datasets' URLs)."""

from __future__ import annotations

import os
import posixpath


def normalize(path: str | bytes) -> bytes:
    """An absolute, normalized path as bytes ('..' resolved lexically)."""
    p = os.fsencode(path)
    if not p.startswith(b"/"):
        p = b"/" + p
    return posixpath.normpath(p).replace(b"//", b"/")


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask would race
    with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
