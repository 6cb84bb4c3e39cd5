"""The prefetch hints' extended attributes, as the FUSE handlers take them
(the interface is described in fuse/prefetch.py and docs/training-data.md,
"Prefetch through the mount")."""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

import pyfuse3

from shufflefs.fuse.prefetch import PREFETCH_XATTR
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps

log = logging.getLogger("shufflefs.fuse")


async def hint_by_getxattr(ops: ShuffleOps, inode: int, name: bytes) -> bytes:
    """``user.shufflefs.prefetch`` of a directory: the cache's state; of a
    file: hint it; ``user.shufflefs.prefetch/PATHS`` of the root: hint those."""
    if name != PREFETCH_XATTR:
        try:
            return await ops.prefetch.hint_named(inode, name)
        except FsError as exc:  # as it is: a missing hinted path is ENOENT, not ESTALE
            log.info("prefetch hint refused: %s", exc.message)
            raise pyfuse3.FUSEError(exc.code) from None
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
    try:
        await ops.prefetch.hint_batch(value)
    except FsError as exc:  # as it is: a missing hinted path is ENOENT, not ESTALE
        log.info("prefetch hint refused: %s", exc.message)
        raise pyfuse3.FUSEError(exc.code) from None
