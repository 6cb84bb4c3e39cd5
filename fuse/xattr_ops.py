"""The extended-attribute handlers of the mount (`XattrOps`, a base of
`shufflefs.fuse.ops.ShuffleOps`): ``user.shufflefs.prefetch`` is the
prefetch hint interface (fuse/prefetch_xattr.py); everything else goes to
the metadata server, with the absence of ``security.capability`` cached."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, cast

import pyfuse3
import trio

from shufflefs.client.fs import FileSystem
from shufflefs.fuse.handler_guards import DirChanges, fuse_errors, mutation, stale_when_gone
from shufflefs.fuse.mount_options import MountOptions
from shufflefs.fuse.prefetch_hints import PREFETCH_XATTR
from shufflefs.fuse.prefetch_xattr import hint_by_getxattr, hint_by_setxattr
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps

CAPS_XATTR = b"security.capability"


class XattrOps:
    # set by ShuffleOps
    fs: FileSystem
    options: MountOptions
    # inode -> trio time until which it is taken to have no security.capability
    no_caps: dict[int, float]
    dir_changes: DirChanges  # (what `mutation` needs)

    @fuse_errors
    @stale_when_gone
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The kernel asks for security.capability before every write(2) (must
        # the write drop file capabilities?), since a FUSE inode never gets
        # S_NOSEC. Its absence is remembered for attr_timeout, as attributes
        # are, so small writes do not each cost a metadata round trip.
        if name.startswith(PREFETCH_XATTR):  # the prefetch hint interface
            return await hint_by_getxattr(cast("ShuffleOps", self), inode, name)
        if self.known_absent(inode, name):
            raise FsError(errno.ENODATA, "no security.capability (cached)")
        caps = name == CAPS_XATTR
        try:
            return await self.fs.getxattr(inode, name)
        except FsError as exc:
            if caps and exc.code == errno.ENODATA:
                self.no_caps[inode] = trio.current_time() + self.options.attr_timeout
            raise

    def known_absent(self, inode: int, name: bytes) -> bool:
        """Is *name* an attribute *inode* is known not to have (the
        security.capability the kernel asks for before every write; also
        answered in libfuse's callback, fuse/fast_answers.py)?"""
        return name == CAPS_XATTR and self.no_caps.get(inode, 0.0) > trio.current_time()

    @fuse_errors
    @stale_when_gone
    @mutation
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        # pyfuse3 checks XATTR_CREATE/XATTR_REPLACE itself (with getxattr)
        # before calling us, so what is left is a plain set
        if name == PREFETCH_XATTR:  # the prefetch hint interface
            await hint_by_setxattr(cast("ShuffleOps", self), inode, value)
            return
        self.no_caps.pop(inode, None)
        await self.fs.setxattr(inode, name, value, 0)
        self.no_caps.pop(inode, None)  # and any absence cached while we set it

    @fuse_errors
    @stale_when_gone
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.fs.listxattr(inode)

    @fuse_errors
    @stale_when_gone
    @mutation
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.removexattr(inode, name)
        self.no_caps.pop(inode, None)
