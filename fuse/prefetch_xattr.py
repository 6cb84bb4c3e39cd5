"""The prefetch hints' extended attributes, as the FUSE handlers take them
(the interface is described in fuse/prefetch.py and docs/training-data.md,
"Prefetch through the mount")."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import pyfuse3

from shufflefs.fuse.prefetch_hints import HELD, PREFETCH_XATTR, QUEUED
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps

log = logging.getLogger("shufflefs.fuse")
T = TypeVar("T")

NAMED_PREFIX = PREFETCH_XATTR + b"/"  # getxattr names that carry paths (`hint_named`)


async def hint_by_getxattr(ops: ShuffleOps, inode: int, name: bytes) -> bytes:
    """``user.shufflefs.prefetch`` of a directory: the cache's state; of a
    file: hint it; ``user.shufflefs.prefetch/PATHS`` of the root: hint those."""
    if name != PREFETCH_XATTR:
        return await refused_as_is(hint_named(ops, inode, name))
    known = ops.reported.get(inode)
    if ops.options.read_only and known is not None and inode in ops.regular:
        # a file as the kernel was told of it: queued with no round trip
        # (the read-only mount's model; fetching opens it)
        return ops.prefetch.hint_inode(inode, known)
    return await ops.prefetch.hint_file(await ops.fs.getattr(inode))


async def hint_by_setxattr(ops: ShuffleOps, inode: int, value: bytes) -> None:
    """A batch of hints set on the mount root."""
    if inode != pyfuse3.ROOT_INODE:
        raise FsError(errno.EINVAL, "prefetch hints are set on the mount root")
    await refused_as_is(ops.prefetch.hint_batch(value))


async def hint_named(ops: ShuffleOps, inode: int, name: bytes) -> bytes:
    """``user.shufflefs.prefetch/`` + paths of the root: the whole files at
    the paths (newline-separated, relative to the root) queued as a batch
    would be; the batch form where the kernel refuses setxattr (a read-only
    mount), and with no LOOKUP of each path by the kernel."""
    lines = [line for line in name[len(NAMED_PREFIX) :].split(b"\n") if line]
    if inode != pyfuse3.ROOT_INODE or not name.startswith(NAMED_PREFIX) or not lines:
        what = "user.shufflefs.prefetch/PATHS is asked of the mount root"
        raise FsError(errno.EINVAL, f"prefetch hint: {what}")
    held = await ops.prefetch.hint_paths([(line, 0, None) for line in lines])
    return HELD if held else QUEUED


async def refused_as_is(hint: Awaitable[T]) -> T:
    """A refused hint's errno as it is (a missing hinted path is ENOENT, not
    the ESTALE of an inode gone), and logged."""
    try:
        return await hint
    except FsError as exc:
        log.info("prefetch hint refused: %s", exc.message)
        raise pyfuse3.FUSEError(exc.code) from None
