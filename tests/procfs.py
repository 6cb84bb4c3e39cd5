"""What a process holds open, read from /proc (for leak checks in tests)."""

from __future__ import annotations

import os
from pathlib import Path


def open_files(pid: int | str) -> list[str]:
    """What each of *pid*'s file descriptors names."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return found


def deleted_open_files(pid: int | str, under: Path) -> list[str]:
    """Files under *under* that *pid* holds open although they were removed:
    their space is not freed while it does."""
    return [t for t in open_files(pid) if t.startswith(str(under)) and t.endswith(" (deleted)")]
