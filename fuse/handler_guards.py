"""The guards every FUSE handler of `shufflefs.fuse.ops.ShuffleOps` goes
through: the one error model at the FUSE boundary (FsError becomes
``FUSEError(errno)``), EROFS on a read-only mount, ESTALE for an inode that
vanished under a cached name."""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import pyfuse3

from shufflefs.fuse.mount_options import MountOptions
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError, as_fs_error

log = logging.getLogger("shufflefs.fuse")

P = ParamSpec("P")
R = TypeVar("R")


class Mutable(Protocol):
    """What `mutation` needs of the operations object."""

    options: MountOptions
    created_in: dict[int, tuple[Attr, float]]
    dir_changes: int


OpsT = TypeVar("OpsT", bound=Mutable)


def fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn any failure into FUSEError(errno), logging what is unexpected."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            code = errno.EIO if exc.code == errno.ENOSYS else exc.code
            if code == errno.EIO:
                log.error("%s: %s", fn.__name__, exc.message)
            raise pyfuse3.FUSEError(code) from None
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(as_fs_error(exc).code) from None

    return wrapper


def mutation(
    fn: Callable[Concatenate[OpsT, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[OpsT, P], Coroutine[Any, Any, R]]:
    """EROFS on a read-only mount. (The kernel refuses most mutations of an
    ``ro`` mount itself; this is the daemon's own guard. Apply under
    `fuse_errors`.) Any mutation but a file's write may change a
    directory: the attributes a create left for its directory's next
    getattr (`ShuffleOps.created_in`) are dropped as it starts and ends, and
    `dir_changes` counts both, so a create that overlapped another mutation
    leaves none."""
    keeps_directories = fn.__name__ == "write"

    @functools.wraps(fn)
    async def wrapper(self: OpsT, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.options.read_only:
            raise FsError(errno.EROFS, "read-only mount (-o ro)")
        if keeps_directories:
            return await fn(self, *args, **kwargs)
        self.created_in.clear()
        self.dir_changes += 1
        try:
            return await fn(self, *args, **kwargs)
        finally:
            self.dir_changes += 1

    return wrapper


def stale_when_gone(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """ENOENT -> ESTALE, for operations that address a single inode by number.

    The kernel reaches an inode through names it caches for entry_timeout; if
    another client removed or replaced the name meanwhile (unlink, rename of a
    new version over it) the inode may be gone, and ENOENT would then fail the
    open or stat of a name that does exist. ESTALE makes the VFS walk the path
    again with LOOKUP_REVAL, which re-validates the cached names (a fresh
    lookup), so the caller gets the file that has the name now, or a true
    ENOENT. (Apply under `fuse_errors`.)"""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except FsError as exc:
            if exc.code == errno.ENOENT:
                raise FsError(errno.ESTALE, exc.message) from None
            raise

    return wrapper
