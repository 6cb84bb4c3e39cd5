"""Small helpers of many tests: run the real `shufflefs` command, damage a
file as a failing disk would. (Clusters are started in clusters.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path


def shufflefs(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the real `shufflefs` command."""
    result = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"shufflefs {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result


def flip(path: str | Path, offset: int) -> None:
    """Corrupt one byte of a file in place (as a failing disk would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def evict(files: Iterable[str | Path], missing_ok: bool = False) -> None:
    """Drop these files' pages from the page cache (reads of them wait for the
    disk). *missing_ok*: a file gone meanwhile (a chunk file a repair replaced)
    is skipped."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            if not missing_ok:
                raise
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def interruptible() -> None:
    """`preexec_fn` of a child a test interrupts with SIGINT: the default
    action back. A test run started as a background job (`cmd &` in a
    non-interactive shell) ignores SIGINT, and a child inherits that: the
    Ctrl-C the test sends would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def owner_mode_mtime(p: Path) -> tuple[int, int, int, int]:
    """*p*'s uid, gid, permission bits and mtime (whole seconds)."""
    st = p.stat()
    return st.st_uid, st.st_gid, st.st_mode & 0o7777, int(st.st_mtime)


def read_whole(p: Path) -> bytes:
    """The file's bytes, by one open, read and close (a loader's sample)."""
    with open(p, "rb") as f:
        return f.read()


def rewrite_in_place(p: Path, data: bytes) -> None:
    """Overwrite the start of *p* without truncating it: with the same size,
    only the inode's change counter tells the versions apart."""
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
