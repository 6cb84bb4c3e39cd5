"""Opening a chunk file only when that cannot wait for the disk.

A read whose chunk file is not among the daemon's open files (`FdCache`)
used to go to a worker thread: every such item, as it might wait for the
disk there. On a dataset larger than the fd cache (one file per sample:
every random read misses it) that cost a warm 110 KB read twice the
daemon's CPU of one whose file was held, in thread hand-offs, although the
file's name and bytes were in the kernel's caches all along. ``openat2``
with ``RESOLVE_CACHED`` (Linux 5.12) opens a file only if every component
of its path is in the dentry cache, and fails with EAGAIN instead of
looking anything up on the disk: the thread that serves a request opens
such files itself, and only what truly waits for the disk is handed on.

Through ``ctypes`` (``os`` has no ``openat2``). Where the call is missing
(an older kernel, a seccomp filter) `open_cached` answers None: the caller
hands the read on as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

SYS_OPENAT2 = 437  # the same on every architecture that has it (the unified table)
RESOLVE_CACHED = 0x20
AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def _load_syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall()


def open_cached(path: str, flags: int) -> int | None:
    """An fd of *path* opened with *flags* (no ``O_CREAT``), or None if the
    open would look part of the path up on the disk, or cannot be asked so
    here. Raises OSError as ``os.open`` does (FileNotFoundError: no such
    file, known from the dentry cache)."""
    global _syscall
    call = _syscall
    if call is None:
        return None
    how = _OpenHow(flags, 0, RESOLVE_CACHED)
    fd = call(
        ctypes.c_long(SYS_OPENAT2),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err == errno.EAGAIN:
        return None
    # no openat2 (ENOSYS, or EPERM from a seccomp filter), or one without
    # RESOLVE_CACHED (EINVAL: Linux 5.6 to 5.11): never ask again
    if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.EINVAL):
        _syscall = None
        return None
    raise OSError(err, os.strerror(err), path)
