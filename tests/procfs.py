"""What a process holds open, read from /proc (for leak checks in tests)."""

from __future__ import annotations

import os
from pathlib import Path


def deleted_open_files(pid: int | str, under: Path) -> list[str]:
    """Files under *under* that *pid* holds open although they were removed:
    their space is not freed while it does."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)) and target.endswith(" (deleted)"):
            found.append(target)
    return found
