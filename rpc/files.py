"""Small state files written durably (node.json, a target's target.json):
after a crash a file holds its old or its new content, whole."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from shufflefs.rpc.errors import FsError


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FsError(errno.EIO, f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise FsError(errno.EIO, f"{path} is not a json object")
    return data


def write_json_durably(path: Path, data: dict[str, Any], fsync: bool = True) -> None:
    """Replace *path* atomically (temp file, fsync, rename, fsync of the
    directory): after a crash it holds the old or the new content, whole."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
