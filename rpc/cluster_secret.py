"""The cluster secret's file: made once by `format`, read by every service
and client (no trio here: the CLI checks a config before it imports it)."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from shufflefs.rpc.errors import FsError


def generate_secret(path: Path) -> bytes:
    """Create a new random cluster secret file readable by its owner only."""
    secret = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret + b"\n")
    finally:
        os.close(fd)
    return secret


def load_secret(path: Path) -> bytes:
    """Read a cluster secret; refuse files others can read (like ssh does)."""
    try:
        st = path.stat()
        data = path.read_bytes().strip()
    except FileNotFoundError:
        raise FsError(errno.ENOENT, f"cluster secret file {path} not found") from None
    except PermissionError:
        raise FsError(errno.EACCES, f"cannot read cluster secret file {path}") from None
    if st.st_mode & 0o077:
        raise FsError(
            errno.EPERM,
            f"cluster secret file {path} is accessible by others "
            f"(mode {st.st_mode & 0o777:o}); run: chmod 600 {path}",
        )
    if len(data) < 16:
        raise FsError(errno.EINVAL, f"cluster secret file {path} is too short")
    return data
