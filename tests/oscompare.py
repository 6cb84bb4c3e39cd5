"""Running the same operations on a local directory and on the mount.

A `Trace` records what each step returned, or the errno name it failed
with, so two traces compare equal exactly when both filesystems behaved the
same way; pytest shows the first step where they differ.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import stat
from collections.abc import Callable
from typing import Any

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = _libc.renameat2
_renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_renameat2.restype = ctypes.c_int


def renameat2(old: str | os.PathLike[str], new: str | os.PathLike[str], flags: int) -> None:
    """renameat2(2) through libc (Python has no binding for it)."""
    if _renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fspath(old))


def errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


class Trace:
    """What a sequence of steps did: values, or errno names."""

    def __init__(self) -> None:
        self.log: list[Any] = []

    def val(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run *fn*; record its value (or its errno)."""
        try:
            value = fn()
        except OSError as exc:
            self.log.append((what, errname(exc)))
            return None
        self.log.append((what, value))
        return value

    def ok(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run *fn*; record only that it worked (or its errno), e.g. for an fd."""
        try:
            value = fn()
        except OSError as exc:
            self.log.append((what, errname(exc)))
            return None
        self.log.append((what, "ok"))
        return value

    def note(self, what: str, value: Any) -> None:
        self.log.append((what, value))


def digest(data: bytes) -> str:
    """A short stand-in for bytes in a trace (long bytes make unreadable diffs)."""
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()[:16]}"


def stat_summary(st: os.stat_result) -> tuple[str, int, int, int]:
    """What two filesystems must agree on: type, permission bits, size (for
    files and symlinks), link count. Not inode numbers, times or a directory's size."""
    kind = stat.S_IFMT(st.st_mode)
    size = -1 if stat.S_ISDIR(st.st_mode) else st.st_size
    return (oct(kind), st.st_mode & 0o7777, size, st.st_nlink)
