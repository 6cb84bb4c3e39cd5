"""The guards every FUSE handler of `shufflefs.fuse.ops.ShuffleOps` goes
through: the one error model at the FUSE boundary (FsError becomes
``FUSEError(errno)``), EROFS on a read-only mount, ESTALE for an inode that
vanished under a cached name."""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import pyfuse3
import trio

from shufflefs.fuse import device_reader
from shufflefs.fuse.mount_options import MountOptions
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError, as_fs_error

log = logging.getLogger("shufflefs.fuse")

P = ParamSpec("P")
R = TypeVar("R")


# The handler arguments (after self) naming the directories an operation may
# change. Any other mutation (rename, rmdir: a directory's own attributes
# change too, and it is not named) may change every directory.
CHANGED_DIRS: dict[str, tuple[int, ...]] = {
    "create": (0,),
    "mkdir": (0,),
    "mknod": (0,),
    "symlink": (0,),
    "unlink": (0,),  # (never a directory's own entry: rmdir)
    "link": (0, 1),  # (a file's attributes, and its new parent's)
    "setattr": (0,),
    "setxattr": (0,),
    "removexattr": (0,),
}


class DirChanges:
    """Directory attributes a create's or an unlink's reply carried
    (`replied`: they answer the one getattr of the directory that the
    change causes), and the
    mutations begun or ended per directory while any of it is in flight, so
    that a create overlapped by another mutation of *its* directory leaves
    none (its reply may predate that mutation), while creates in other
    directories do not spoil it. Counters live only while a directory has a
    mutation in flight."""

    def __init__(self) -> None:
        # directory inode -> (its attributes from our last create or unlink
        # in it, trio time until which they answer the one getattr it causes)
        self.replied: dict[int, tuple[Attr, float]] = {}
        self._changes: dict[int, int] = {}  # directory -> mutations begun or ended
        self._busy: dict[int, int] = {}  # directory -> mutations in flight
        self._everywhere = 0  # mutations of any directory begun or ended

    def begin(self, dirs: tuple[int, ...] | None) -> None:
        """A mutation of *dirs* (None: of any directory) begins: what
        creates left for them is dropped (a create whose reply comes later
        and records again was overlapped by this one, and `alone` says so)."""
        if dirs is None:
            self.replied.clear()
            self._everywhere += 1
            return
        for d in dirs:
            self.replied.pop(d, None)
            self._changes[d] = self._changes.get(d, 0) + 1
            self._busy[d] = self._busy.get(d, 0) + 1

    def end(self, dirs: tuple[int, ...] | None) -> None:
        if dirs is None:
            self._everywhere += 1
            return
        for d in dirs:
            self._changes[d] += 1
            left = self._busy[d] - 1
            if left:
                self._busy[d] = left
            else:
                del self._busy[d], self._changes[d]

    def stamp(self, directory: int) -> tuple[int, int]:
        """Taken by a mutation of *directory* (begun, not ended)."""
        return self._changes[directory], self._everywhere

    def alone(self, directory: int, stamp: tuple[int, int]) -> bool:
        """No other mutation of *directory* began or ended since *stamp*."""
        return self.stamp(directory) == stamp

    def reply_carried(
        self, directory: int, attr: Attr | None, stamp: tuple[int, int], timeout: float
    ) -> None:
        """A mutation of *directory* (which took *stamp*) answered with its
        attributes after it: unless another mutation of it overlapped (the
        reply may predate that one), they answer the kernel's next getattr
        of it for *timeout* seconds (its attr_timeout)."""
        if attr is not None and timeout > 0 and self.alone(directory, stamp):
            self.replied[directory] = (attr, trio.current_time() + timeout)


class Mutable(Protocol):
    """What `mutation` needs of the operations object."""

    options: MountOptions
    dir_changes: DirChanges


OpsT = TypeVar("OpsT", bound=Mutable)


def fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn any failure into FUSEError(errno), logging what is unexpected."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        device_reader.hand_over()  # (it may wait: another worker takes the device)
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
    directory (`CHANGED_DIRS` says which): the attributes a create left for
    such a directory's next getattr are dropped as it begins and ends, and
    `DirChanges` counts both, so a create that overlapped another mutation
    of its directory leaves none."""
    keeps_directories = fn.__name__ == "write"
    changed = CHANGED_DIRS.get(fn.__name__)

    @functools.wraps(fn)
    async def wrapper(self: OpsT, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.options.read_only:
            raise FsError(errno.EROFS, "read-only mount (-o ro)")
        if keeps_directories:
            return await fn(self, *args, **kwargs)
        # (pyfuse3 passes them by position; named, they count as every directory)
        dirs = None
        if changed is not None and len(args) > max(changed):
            dirs = tuple(cast("int", args[k]) for k in changed)
        self.dir_changes.begin(dirs)
        try:
            return await fn(self, *args, **kwargs)
        finally:
            self.dir_changes.end(dirs)

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
