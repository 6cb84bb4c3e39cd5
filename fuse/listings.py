"""Directory listings of the FUSE mount: OPENDIR, READDIRPLUS, RELEASEDIR,
and how long the kernel may keep a listing.

The kernel can keep a directory's listing in its page cache
(``FOPEN_CACHE_DIR``) and answer later listings from it with no upcall but
the OPENDIR and RELEASEDIR around them; an OPENDIR answered without
``FOPEN_KEEP_CACHE`` makes it drop what it kept and list afresh. What each
mode lets it keep (`flags`, asked by the trampoline in front of pyfuse3's
opendir, fuse/read_inode.py):

* read-write, with a cache watch: the first page of a listing is read by
  `watch_dir`, which makes the metadata server tell this mount's watch of
  the directory's next change before that change is acknowledged
  (metadata/cache_watch.py, as for the files it caches). While the watch
  says the directory is unchanged since (`CacheWatch.dir_attr`), an OPENDIR
  keeps the kernel's listing and asks nothing: close-to-open holds for
  names as it does for data. Told of a change, the mount drops the kernel's
  listing and attributes of the directory at once (`changed`: for a
  listing already open that starts over), and the next OPENDIR lists
  afresh, watching again.
* ``ro``: the kernel keeps listings, and drops one when a listing starts
  after the directory's attributes expired (``attr_timeout``) and the fresh
  ones show another mtime (a name created or removed in it): the bound that
  mode states for every change made elsewhere.
* ``cache=immutable``: no OPENDIR at all (answered ENOSYS once: the kernel
  then keeps every listing, as with ``ro``); READDIRPLUS names its
  directory through the read trampoline and resumes from the one cursor
  state of that directory (`listing`).
* read-write without a watch: listings are not kept.

A listing longer than a page (`READDIR_PAGE` entries: a class directory of
ImageNet has six, COCO's one directory 463) reads each next page while the
kernel takes the one before (`_read_next`): the metadata server's work on a
page overlaps the mount's and the kernel's on the last, and the listing
waits for the server once rather than once a page. A page so read is as old
as the later half of one page twice the size read at once, and aged by the
wait like a first page read ahead.
"""

from __future__ import annotations

import errno
import logging
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyfuse3
import trio
from pyfuse3 import readdir_reply

from shufflefs.fuse.dir_handles import READDIR_PAGE, DirHandle, Offsets, dot_entry
from shufflefs.fuse.page_store import invalidate_pages
from shufflefs.fuse.read_inode import CACHE_DIR_BIT, KEEP_CACHE_BIT, READ_INODES
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps


log = logging.getLogger("shufflefs.fuse")


class Listings:
    def __init__(self, ops: ShuffleOps) -> None:
        self.ops = ops
        self.watch = ops.fs.cache_watch if not ops.options.read_only else None
        self.dirs: dict[int, DirHandle] = {}  # OPENDIR's handles
        self.by_inode: dict[int, DirHandle] = {}  # cache=immutable: directory inode -> its listing
        self.offsets: dict[int, Offsets] = {}  # directory inode -> the offsets of its listings
        self._next = 1
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Drop a watched directory's kernel listing when told of a change."""
        self._nursery = nursery
        if self.watch is not None:
            self.watch.dir_changed = self.changed

    def flags(self, ino: int) -> int:
        """OPENDIR's caching flags for directory *ino* (see the module's
        docstring); asked as the OPENDIR arrives, before `open`."""
        if self.ops.options.read_only:
            return CACHE_DIR_BIT | KEEP_CACHE_BIT
        if self.watch is None:
            return 0
        if self.watch.dir_attr(ino) is None:
            return CACHE_DIR_BIT  # filled afresh by this listing, watched from its first page
        return CACHE_DIR_BIT | KEEP_CACHE_BIT

    def changed(self, ino: int) -> None:
        """The watch was told of a change of directory *ino*: drop what the
        kernel keeps of it (in a thread: dropping a listing waits for its
        pages, which a listing in progress may hold)."""
        self.ops.list_ahead.changed(ino)
        if self._nursery is not None:
            self._nursery.start_soon(trio.to_thread.run_sync, invalidate_pages, ino)

    async def open(self, inode: int) -> int:
        if self.ops.inode_reads is not None:
            # no OPENDIR/RELEASEDIR from now on, listings cached by the
            # kernel (FOPEN_CACHE_DIR): READDIRPLUS names its directory
            raise pyfuse3.FUSEError(errno.ENOSYS)
        fh = self.open_now(inode)
        if fh is not None:
            return fh
        # (a read-write mount checks the directory is still there)
        attr = await self.ops.fs.getattr(inode)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, "not a directory")
        return self._handle(inode, attr["parent"] or inode)

    def open_now(self, inode: int) -> int | None:
        """OPENDIR's handle when the mount knows the directory's parent
        (``ro``: from a lookup or listing; read-write: while the cache watch
        keeps the directory), else None: ask (`open`). Also answered in
        libfuse's callback (fuse/fast_answers.py)."""
        if self.ops.inode_reads is not None:
            return None
        parent = self.ops.parents.get(inode) if self.ops.options.read_only else None
        if parent is None and self.watch is not None:
            watched = self.watch.dir_attr(inode)  # unchanged since it was read
            parent = None if watched is None else watched["parent"] or inode
        return None if parent is None else self._handle(inode, parent)

    def _handle(self, inode: int, parent: int) -> int:
        fh = self._next
        self._next += 1
        self.dirs[fh] = DirHandle(inode, parent, self._offsets(inode))
        return fh

    def release(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    def forget(self, inos: Iterable[int]) -> None:
        """The kernel forgot inodes *inos*: no listing of them is cached there."""
        for table in (self.by_inode, self.offsets):
            if table:
                pop = table.pop
                for ino in inos:
                    pop(ino, None)

    def _offsets(self, ino: int) -> Offsets:
        offsets = self.offsets.get(ino)
        if offsets is None:
            kept = self.ops.kept_listings.kept.get(ino)  # (its offsets go on)
            offsets = self.offsets[ino] = Offsets() if kept is None else kept.offsets
        return offsets

    def listing(self, ino: int) -> DirHandle:
        """cache=immutable: the one cursor state of directory *ino* (no
        OPENDIR: every listing of it resumes from offsets handed out here;
        the kernel lists a directory once and answers from its cache)."""
        h = self.by_inode.get(ino)
        if h is None:
            h = self.by_inode[ino] = DirHandle(
                ino, self.ops.parents.get(ino, 0), self._offsets(ino)
            )
        return h

    async def read(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        ops = self.ops
        h = self.dirs.get(fh)
        if ops.inode_reads is not None and fh == 0:
            h = self.listing(READ_INODES.take())  # first: this READDIRPLUS's directory
            if h.parent == 0:  # its first listing here
                h.parent = (await ops.fs.getattr(h.ino))["parent"] or h.ino
        if h is None:
            raise FsError(errno.EBADF, "directory not open")
        if start_id <= 1:
            h.ended = False  # a listing from the start reads afresh
        if start_id <= 2:
            after: bytes | None = None
        else:
            after = h.offsets.names.get(start_id)
            if after is None:
                raise FsError(errno.EINVAL, f"stale directory offset {start_id}")
        if h.ended and after == h.end_after and not h.pending:
            return  # the last page ended here
        # the records of pages read before (fuse/kept_listings.py: the
        # callback answers from them too, unless it could not)
        records = ops.kept_listings
        if start_id > 2 and records.into_reply(h.ino, start_id, token, told=False):
            return
        # (the loop runs once per entry of every listing: what it calls is
        # looked up once)
        offset_of, entry_of, lookups, reply = h.offsets.of, ops.entry, ops.lookups, readdir_reply
        extend = None if ops.watched is None else ops.watched.extend
        off = start_id
        while True:
            if h.pending and h.pending_after == after:
                entries, more = h.pending, h.pending_more
            else:
                entries, more, h.age = await self._page(h, after)
                ops.list_ahead.listed(h.ino, after is None, entries)
                ops.dir_ahead.listed(h.ino, entries)
                records.page(h.ino, h.parent, after, entries, more, h.age, h.offsets)
                if records.into_reply(h.ino, off, token, told=True):
                    h.pending = []  # (the rest of the page: from its records)
                    return
            if off <= 1:  # '.' and '..' first
                if off == 0 and not reply(token, b".", dot_entry(h.ino), 1):
                    h.pending, h.pending_after, h.pending_more = entries, after, more
                    return
                if not reply(token, b"..", dot_entry(h.parent), 2):
                    h.pending, h.pending_after, h.pending_more = entries, after, more
                    return
                off = 2
            age, dir_ino = h.age, h.ino
            for i, (name, attr) in enumerate(entries):
                entry = entry_of(attr, age)
                if extend is not None:
                    extend(entry, dir_ino, name)
                if not reply(token, name, entry, offset_of(name)):
                    h.pending, h.pending_after, h.pending_more = entries[i:], after, more
                    return
                ino = attr["ino"]
                lookups[ino] = lookups.get(ino, 0) + 1
                after = name
            h.pending = []
            if not more or not entries:
                h.ended, h.end_after = True, after
                return
            assert after is not None  # (the page's last entry)
            off = offset_of(after)

    async def _page(
        self, h: DirHandle, after: bytes | None
    ) -> tuple[list[tuple[bytes, Attr]], bool, float]:
        """A page of directory *h*'s listing after *after*, whether more
        follow, and the page's age in seconds (a first page read ahead:
        fuse/list_ahead.py; a later one read while the kernel took the one
        before it: `_read_next`)."""
        ino = h.ino
        if after is None:
            await self.ops.list_ahead.arriving(ino)
            held = self.ops.list_ahead.take(ino, h.parent)
            if held is not None:
                page, age = held
                self._read_next(h, page["entries"], page["more"])
                return page["entries"], page["more"], age
        elif h.ahead_done is not None and h.ahead_after == after:
            done = h.ahead_done
            await done.wait()
            # (another listing of a shared cursor state may have taken it)
            ahead = h.ahead_page if h.ahead_done is done else None
            if ahead is not None:
                h.ahead_done, h.ahead_page = None, None
                self.ops.list_ahead.counts.next_taken += 1
                entries, more, read_at = ahead
                self._read_next(h, entries, more)
                return entries, more, trio.current_time() - read_at
        # a first page is read by the cache watch, which keeps the listing
        page = await self.ops.fs.readdir(ino, after, READDIR_PAGE, watch=self.watch is not None)
        self._read_next(h, page["entries"], page["more"])
        return page["entries"], page["more"], 0.0

    def _read_next(self, h: DirHandle, entries: list[tuple[bytes, Attr]], more: bool) -> None:
        """A page of *h* with *more* after it came: read the next one now,
        while the kernel takes this one (a page holds several READDIRPLUS
        replies' worth), so that a listing of a large directory waits for
        the metadata server once rather than once a page. What it hands
        out is no older than one page of twice the size read at once."""
        if not more or not entries or self._nursery is None:
            return
        h.ahead_after, h.ahead_done, h.ahead_page = entries[-1][0], trio.Event(), None
        self.ops.list_ahead.counts.next_read += 1
        self._nursery.start_soon(self._fetch_next, h, h.ahead_after, h.ahead_done)

    async def _fetch_next(self, h: DirHandle, after: bytes, done: trio.Event) -> None:
        try:
            page = await self.ops.fs.readdir(h.ino, after, READDIR_PAGE)
        except FsError as exc:  # the listing reads it itself, and meets the error
            log.debug("reading ahead directory %d after %r: %s", h.ino, after[:64], exc.message)
        else:
            if h.ahead_done is done:
                h.ahead_page = (page["entries"], page["more"], trio.current_time())
        finally:
            done.set()
