"""pyfuse3 operations over the client library.

Kernel caching (the modes and their timeouts: fuse/mount_options.py; what a
reader sees when: docs/operations.md, "Mount modes and caches"):

* readdir is readdirplus, so a listing fills the entry and attribute cache;
  the kernel keeps listings as long as each mode allows (fuse/listings.py);
* an open keeps the kernel's pages of a file (``keep_cache``) only if the
  file is the version this mount last cached (`kernel_opened`), and drops
  the kernel's attributes whenever they differ from fresh ones (also of a
  file only stat'ed), so reads are not clamped to a stale size; how an open
  knows the version is current: client/open_cache.py, client/cache_watch.py
  (the read-write mount), fuse/inode_reads.py (``cache=immutable``);
* an O_APPEND open while the kernel's size is stale writes at the real end
  (see `file_info` and `write`);
* a file written through this mount drops its cache marker on release, so
  the next open re-validates;
* the absence of ``security.capability`` (asked before every write) is
  cached for ``attr_timeout``;
* a create's reply carries its directory's new attributes, which answer
  the getattr the kernel sends for that directory next (it drops its cached
  ones on every create), within ``attr_timeout`` and until any other
  mutation of this mount: one round trip less per file created.

Errors: every handler turns FsError into ``FUSEError(errno)``; ENOSYS is
sent as EIO, because the kernel would take ENOSYS to mean "never call this
operation again" for the rest of the mount. An operation addressing one inode
by number answers ESTALE, not ENOENT, when that inode is gone (see
`stale_when_gone`).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
from collections.abc import Sequence
from itertools import compress

import pyfuse3
import trio

from shufflefs.client.fs import ACCESS_MODE, FileSystem
from shufflefs.fuse import device_reader
from shufflefs.fuse.dir_ahead import DirAhead
from shufflefs.fuse.entry_attrs import (
    BLOCK_SIZE,
    entry_attributes,
    no_longer_than,
    setattr_fields,
)
from shufflefs.fuse.handler_guards import DirChanges, fuse_errors, mutation, stale_when_gone
from shufflefs.fuse.inode_reads import InodeReads
from shufflefs.fuse.kept_listings import KeptListings
from shufflefs.fuse.list_ahead import HOLD, ListAhead
from shufflefs.fuse.listings import Listings
from shufflefs.fuse.mount_options import MountOptions
from shufflefs.fuse.now_answers import NowAnswers
from shufflefs.fuse.page_store import KernelPages
from shufflefs.fuse.prefetch import Prefetcher
from shufflefs.fuse.prefetch_hints import Version, version_of
from shufflefs.fuse.read_inode import READ_INODES
from shufflefs.fuse.watched_entries import WatchedEntries
from shufflefs.fuse.writeback import WritebackCloses
from shufflefs.fuse.xattr_ops import XattrOps
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.fuse")

# s: a mount hinted this recently leaves its files to the prefetcher (a
# hinting loader sends hints every few milliseconds; an unhinted epoch right
# after a hinted one gets dir_ahead back this soon)
HINTED_LATELY = 2.0


class ShuffleOps(NowAnswers, XattrOps, pyfuse3.Operations):
    def __init__(self, fs: FileSystem, options: MountOptions | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.options = options or MountOptions()
        # read by pyfuse3 when the kernel's INIT comes (FUSE_CAP_WRITEBACK_CACHE)
        self.enable_writeback_cache = self.options.writeback_cache
        self.lookups: dict[int, int] = {}  # inode -> the kernel's lookup count
        # inode -> (size, mtime, ctime) of its cached data
        self.cached: dict[int, tuple[int, int, int]] = {}
        # inode -> (size, mtime, ctime) of the attributes last handed to the kernel
        self.reported: dict[int, tuple[int, int, int]] = {}
        # inode -> trio time until which it is taken to have no security.capability
        self.no_caps: dict[int, float] = {}
        # directory attributes creates left, mutations of directories in flight (`mutation`)
        self.dir_changes = DirChanges()
        self.append_direct: set[int] = set()  # O_APPEND handles that write at the real end
        self.kernel_size: dict[int, int] = {}  # inode -> i_size as the kernel has it
        self.parents: dict[int, int] = {}  # directory inode -> its parent, as last told
        self.regular: set[int] = set()  # inodes the kernel was told are regular files
        # inode -> bytes from offset 0 handed to the kernel without a gap, for
        # the version in `cached`: what its page cache holds unless it evicted
        self.read_through: dict[int, int] = {}
        pages = KernelPages(self)  # what the kernel's page cache holds, and stores into it
        self.prefetch = Prefetcher(fs, self.options.prefetch_memory, pages.holds, pages.store)
        # cache=immutable with kernel-served reads: handles by inode (`serve_by_inode`)
        self.inode_reads: InodeReads | None = None
        # rw with a cache watch: kernel entries of files it keeps fresh live longer
        self.watched = WatchedEntries(fs) if fs.cache_watch is not None else None
        self.listings = Listings(self)  # directories: opendir, readdir, releasedir
        # whole listings kept (names only on rw), answered in libfuse's callback
        self.kept_listings = KeptListings(self, self.options.keep_listings)
        # a directory's files opened ahead on a lookup miss in it
        self.dir_ahead = DirAhead(
            fs,
            self.watched,
            self.options.dir_ahead,
            self.options.entry_timeout,
            # a loader hinting its order has its files fetched with no open
            aside=lambda: self.prefetch.hinted_within(HINTED_LATELY),
        )
        # the listings of the subdirectories after the one being listed
        self.list_ahead = ListAhead(
            fs,
            fs.cache_watch,
            self.watched,
            self.options.list_ahead,
            self._list_hold(),
            min(self.options.entry_timeout, self.options.attr_timeout)
            if self.options.read_only
            else 0.0,
        )
        self.list_ahead.kept = self.kept_listings.fresh
        self._nursery: trio.Nursery | None = None
        self.writeback = WritebackCloses(fs) if self.options.writeback else None

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.writeback is not None:
            self.writeback.start(nursery)
        self.listings.start(nursery)
        self.list_ahead.start(nursery)
        await self.prefetch.start(nursery)

    def serve_by_inode(self) -> None:
        """cache=immutable, once READs name their inode (fuse/read_inode.py):
        OPEN answers ENOSYS from now on (see fuse/inode_reads.py)."""
        assert self._nursery is not None, "start() first"
        self.inode_reads = InodeReads(self, self.options.handle_linger)
        self._nursery.start_soon(self.inode_reads.sweep)

    def _list_hold(self) -> float:
        """How long a listing read ahead may wait (fuse/list_ahead.py): no
        longer than the mode lets the kernel keep what it brings."""
        return min(HOLD, self.options.attr_timeout, self.options.entry_timeout)

    # ---- conversions ----------------------------------------------------------

    def entry(self, attr: Attr, age: float = 0.0) -> pyfuse3.EntryAttributes:
        """*attr* as the kernel is given them (*age*: seconds since they
        were read, which the kernel may keep them that much less)."""
        ino, version = attr["ino"], version_of(attr)
        if self.inode_reads is not None and self._nursery is not None:
            self.inode_reads.seen(ino, self._nursery, version)
        self.reported[ino] = version
        self.kernel_size[ino] = attr["size"]
        if attr["parent"]:
            self.parents[ino] = attr["parent"]
        elif stat.S_ISREG(attr["mode"]):
            self.regular.add(ino)
        options = self.options
        return entry_attributes(attr, options.entry_timeout, options.attr_timeout, age)

    def told_many(
        self,
        inos: list[int],
        versions: list[Version],
        parents: list[int],
        regular: list[bool],
    ) -> None:
        """What `entry` notes, for each entry of a kept listing handed to
        the kernel (fuse/kept_listings.py), and its lookup count."""
        if self.inode_reads is not None and self._nursery is not None:
            seen, nursery = self.inode_reads.seen, self._nursery
            for ino, version in zip(inos, versions, strict=True):
                seen(ino, nursery, version)
        self.reported.update(zip(inos, versions, strict=True))
        self.kernel_size.update(zip(inos, [v[0] for v in versions], strict=True))
        self.parents.update([(i, p) for i, p in zip(inos, parents, strict=True) if p])
        self.regular.update(compress(inos, regular))
        lookups = self.lookups
        for ino in inos:
            lookups[ino] = lookups.get(ino, 0) + 1

    def opened_at_server(self, attr: Attr) -> None:
        """A read-only open the open cache could not answer (fuse/dir_ahead.py,
        `DirAhead.opened`)."""
        if self._nursery is not None:
            self.dir_ahead.opened(attr, self._nursery)

    def remember(self, attr: Attr) -> pyfuse3.EntryAttributes:
        """An entry handed to the kernel: its lookup count rises by one."""
        ino = attr["ino"]
        self.lookups[ino] = self.lookups.get(ino, 0) + 1
        return self.entry(attr)

    # ---- names and attributes ------------------------------------------------------

    @fuse_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        keep = math.inf
        try:
            cached = self._cached_entry(parent_inode, name)
            if cached is not None:
                attr, keep = cached
            elif self._known_absent(parent_inode, name):
                return self._missing()
            elif self.watched is not None or self.options.read_only:
                # the open that follows comes from the open cache
                attr = await self.fs.lookup_open(parent_inode, name)
                if self._nursery is not None:
                    self.dir_ahead.missed(parent_inode, attr, self._nursery)
            else:
                attr = await self.fs.lookup(parent_inode, name)
        except FsError as exc:
            if exc.code != errno.ENOENT or not self.options.negative_timeout:
                raise
            return self._missing()
        if self.inode_reads is None:
            return self._found(attr, keep, parent_inode, name)
        await self.inode_reads.pages_current(attr)
        return no_longer_than(self.remember(attr), keep)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        device_reader.hand_over()  # (its drops may wait: see fuse/device_reader.py)
        lookups = self.lookups
        gone: list[int] = []
        for ino, n in inode_list:
            left = lookups.get(ino, 0) - n
            if left > 0:
                lookups[ino] = left
            else:
                lookups.pop(ino, None)
                gone.append(ino)
        if not gone:
            return
        # what the mount kept of each, before anything waits (a LOOKUP
        # answered meanwhile starts afresh): one pass per table, empty ones
        # skipped (a drop of the kernel's caches forgets every inode at once,
        # and 20,000 forgotten one at a time through each table were a tenth
        # of a cold listing's time in the mount)
        self.listings.forget(gone)
        self.list_ahead.forgotten(gone)
        for table in (
            self.cached,
            self.read_through,
            self.reported,
            self.kernel_size,
            self.no_caps,
            self.parents,
            self.dir_changes.replied,
        ):
            if table:
                pop = table.pop
                for ino in gone:
                    pop(ino, None)
        self.regular.difference_update(gone)
        if self.inode_reads is not None:
            for ino in gone:
                await self.inode_reads.drop(ino)

    @fuse_errors
    @stale_when_gone
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        entry = self.getattr_now(inode)
        if entry is not None:
            return entry
        attr = await self.fs.getattr(inode)
        if (
            attr["nlink"] == 0
            and stat.S_ISREG(attr["mode"])
            and self.inode_reads is None
            and not self.fs.holds_open(inode)
        ):
            # reached through a name the kernel still caches (entry_timeout)
            # of a file removed since, which someone's open handle keeps:
            # the name is gone (the holder's fstat comes from an open on
            # this mount, and is answered). ESTALE makes the kernel look the
            # name up again: ENOENT, or the file that has it now
            raise FsError(errno.ESTALE, f"inode {inode} was removed")
        if self.inode_reads is not None:
            await self.inode_reads.pages_current(attr)
        return self.entry(attr)

    @fuse_errors
    @stale_when_gone
    @mutation
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        # truncate(path) through a name the kernel still caches, of a file
        # another client removed (kept alive by a handle this mount caches):
        # ESTALE makes the kernel look the name up again and truncate what it
        # names now, not the removed file (ftruncate of an open file comes
        # with its fh and is not asked)
        if (
            fields.update_size
            and fh is None
            and (await self.fs.read_only.fresh_attr(inode))["nlink"] == 0
        ):
            raise FsError(errno.ESTALE, f"inode {inode} was removed")
        attrs = setattr_fields(attr, fields)
        if not fields.update_size and (entry := self.setattr_now(inode, attrs)) is not None:
            return entry
        if self.writeback is not None and fields.update_size:
            await self.writeback.done_with(inode)  # the close behind lands before the cut
        new = await self.fs.setattr(
            inode, size=attr.st_size if fields.update_size else None, **attrs
        )
        if fields.update_size:
            self.cached.pop(inode, None)
            self.read_through.pop(inode, None)
            self.prefetch.changed(inode)
        return self.entry(new)

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        capacity, stats = await self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLOCK_SIZE
        s.f_frsize = BLOCK_SIZE
        s.f_blocks = capacity["capacity"] // BLOCK_SIZE
        s.f_bfree = capacity["free"] // BLOCK_SIZE
        s.f_bavail = capacity["free"] // BLOCK_SIZE
        s.f_files = stats["max_files"]
        s.f_ffree = max(0, stats["max_files"] - stats["files"])
        s.f_favail = s.f_ffree
        s.f_namemax = 255
        return s

    # ---- creating and removing -------------------------------------------------

    @fuse_errors
    @mutation
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @fuse_errors
    @mutation
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_errors
    @mutation
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_errors
    @mutation
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.remember(await self.fs.link(inode, new_parent_inode, new_name))

    @fuse_errors
    @stale_when_gone
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(inode)

    @fuse_errors
    @mutation
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        stamp = self.dir_changes.stamp(parent_inode)
        parent_attr = await self.fs.unlink(parent_inode, name)
        self.dir_changes.reply_carried(parent_inode, parent_attr, stamp, self.options.attr_timeout)
        self.prefetch.name_changed(parent_inode, name)

    @fuse_errors
    @mutation
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(parent_inode, name)

    @fuse_errors
    @mutation
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
        self.prefetch.name_changed(parent_inode_old, name_old)
        self.prefetch.name_changed(parent_inode_new, name_new)

    # ---- files ------------------------------------------------------------------

    def file_info(self, fh: int, attr: Attr, flags: int) -> pyfuse3.FileInfo:
        """keep_cache only if the data the kernel may hold is still current
        (`kernel_opened`); direct_io for an O_APPEND handle whose kernel
        size is stale."""
        keep = self.kernel_opened(attr)
        # An O_APPEND write goes to the kernel's cached i_size, which it does
        # not refresh first (only with the writeback cache): if that size is
        # not the real one, `write` puts such a handle's writes at the real
        # end, and direct_io keeps the kernel from copying them into its page
        # cache at the stale offset. (Only then: direct_io handles cannot be
        # mmapped MAP_SHARED.)
        direct = bool(flags & os.O_APPEND) and self.kernel_size.get(attr["ino"]) != attr["size"]
        if direct:
            self.append_direct.add(fh)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=direct)

    def kernel_opened(self, attr: Attr) -> bool:
        """A file was opened at *attr* (by an OPEN, or on cache=immutable by
        its first READ): whether the kernel's pages of it are of this
        version; its cached attributes dropped if they are not current."""
        ino = attr["ino"]
        version = version_of(attr)
        previous = self.cached.get(ino)
        keep = previous == version
        # The kernel may hold attributes from a lookup/getattr/readdir even if
        # this mount never opened the file (previous is None): compare with what
        # it was last told, else a file another client extended right after
        # our stat reads short (the kernel clamps reads to its cached i_size).
        stale = (previous is not None and not keep) or self.reported.get(ino) != version
        if stale:
            try:
                pyfuse3.invalidate_inode(ino, attr_only=True)
                self.reported.pop(ino, None)
            except OSError as exc:
                log.debug("invalidate_inode(%d): %s", ino, exc)
        self.cached[ino] = version
        if not keep:
            self.read_through.pop(ino, None)
        return keep

    @fuse_errors
    @stale_when_gone
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        changes = flags & ACCESS_MODE != os.O_RDONLY or flags & os.O_TRUNC
        if self.options.read_only and changes:
            raise FsError(errno.EROFS, "read-only mount (-o ro)")
        if self.writeback is not None and changes:
            await self.writeback.done_with(inode)
        if self.inode_reads is not None:
            # the kernel sends no OPEN (nor FLUSH or RELEASE) from now on
            # and keeps every file's pages: READs name their inode
            raise pyfuse3.FUSEError(errno.ENOSYS)
        f, attr = await self.fs.open(inode, flags)
        if not changes:
            self.opened_at_server(attr)
        if attr["nlink"] == 0 and not stat.S_ISDIR(attr["mode"]):
            # reached through a name the kernel still caches, of a file
            # removed since (kept alive by someone's open handle, or a
            # mount's cached one): ESTALE makes the kernel look the name up
            # again, so the open gets what the name is now (or ENOENT, or
            # with O_CREAT a new file) rather than the removed file
            await self.fs.release(f.fh)
            raise FsError(errno.ESTALE, f"inode {inode} was removed")
        return self._opened(f.fh, attr, flags)

    @fuse_errors
    @mutation
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        stamp = self.dir_changes.stamp(parent_inode)
        f, attr = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        if f.created and self.watched is not None and self.fs.cache_watch is not None:
            # the directory's names, for the LOOKUPs of the next names created
            # in it (the kernel holds the directory: none of our changes of it
            # overlap); not on a lookup that finds nothing: a mount that only
            # looks (a rank checking for a checkpoint) would make the
            # directory's writer wait for its acknowledgement
            await self.fs.cache_watch.learn_names(parent_inode)
        if f.created:  # a new file has no security.capability: spare the write's getxattr
            self.no_caps[attr["ino"]] = trio.current_time() + self.options.attr_timeout
        self.dir_changes.reply_carried(
            parent_inode, f.parent_attr, stamp, self.options.attr_timeout
        )
        entry = self.remember(attr)  # first, so file_info sees the kernel is told these
        return self.file_info(f.fh, attr, flags), entry

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytearray | memoryview:  # type: ignore[override]
        # pyfuse3 replies from any contiguous buffer (its stub says bytes):
        # the bytes go to the kernel without a copy into a bytes object
        if self.inode_reads is not None:
            named = READ_INODES.take()  # first: this READ's inode (fuse/read_inode.py)
            if fh == 0:
                ahead = self.inode_reads.read_unopened(named, off, size)
                if ahead is None:
                    ahead = await self.inode_reads.read_prefetching(named, off, size)
                if ahead is not None:
                    return ahead
                fh = await self.inode_reads.handle(named)
        else:
            READ_INODES.confirm(fh)  # what the fast path reads as the handle (fuse/fast_reads.py)
        return await self.read_handle(fh, off, size)

    @fuse_errors
    async def read_handle(self, fh: int, off: int, size: int) -> bytearray | memoryview:
        """A READ of an open client handle (also the fast path's fallback)."""
        ino = self.fs.file(fh).ino
        ahead = await self.prefetch.read_or_wait(ino, off, size)
        got = ahead if ahead is not None else await self.fs.read(fh, off, size)
        self.handed(ino, off, len(got))
        return got

    @fuse_errors
    @mutation
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        f = self.fs.file(fh)
        at = off
        if fh in self.append_direct:
            # an O_APPEND handle opened while the kernel's i_size was stale
            # (see file_info): after another client changed the length, the
            # kernel's offset would overwrite that client's tail or leave a
            # hole. The client's size (fresh from the open, plus this mount's
            # own writes) is the real end; the kernel sends one inode's
            # writes one at a time, so each lands after the previous.
            at = self.fs.known_size(f.ino)
        n = await self.fs.write(fh, at, buf)
        self._written(f.ino, off + n)
        return n

    @fuse_errors
    async def flush(self, fh: int) -> None:
        if self.options.read_only:
            # nothing to report on close: ENOSYS makes the kernel stop
            # sending FLUSH for the rest of the mount (one round trip less
            # per close)
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if self.writeback is not None:
            return  # the release does it, behind (fuse/writeback.py)
        await self.fs.flush(fh)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh)

    @fuse_errors
    async def release(self, fh: int) -> None:
        READ_INODES.confirm(fh)  # what the fast path reads as the handle (fuse/fast_answers.py)
        f = self.fs.files.get(fh)
        if f is None:
            self.append_direct.discard(fh)
        else:
            self._released(fh, f.ino, f.writable)
            if f.writable and self.writeback is not None:
                await self.writeback.close(fh, f.ino)
                return
        await self.fs.release(fh, unwaited=True)  # (close(2) returned after the FLUSH)

    # ---- directories ------------------------------------------------------------------

    @fuse_errors
    @stale_when_gone
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.listings.open(inode)

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        await self.listings.read(fh, start_id, token)

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        READ_INODES.confirm(fh)  # what the fast path reads as the handle (fuse/fast_answers.py)
        self.listings.release(fh)

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None
