"""The answers of `ShuffleOps` that need no round trip and no wait (a base
of it): what the mount's caches answer, and what goes behind at once. Each
is offered the request in libfuse's callback first (fuse/fast_answers.py)
and, where it declines (None, False), the async handler of the same
operation (fuse/ops.py) takes it through pyfuse3, trying the same answer
first. The bookkeeping they share with those handlers is here too."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pyfuse3
import trio

from shufflefs.fuse.entry_attrs import no_longer_than
from shufflefs.metadata.protocol import Attr, OwedAttrs

if TYPE_CHECKING:
    from shufflefs.client.fs import FileSystem
    from shufflefs.fuse.dir_ahead import DirAhead
    from shufflefs.fuse.handler_guards import DirChanges
    from shufflefs.fuse.inode_reads import InodeReads
    from shufflefs.fuse.list_ahead import ListAhead
    from shufflefs.fuse.mount_options import MountOptions
    from shufflefs.fuse.prefetch import Prefetcher
    from shufflefs.fuse.watched_entries import WatchedEntries
    from shufflefs.fuse.writeback import WritebackCloses


class NowAnswers:
    if TYPE_CHECKING:
        fs: FileSystem
        options: MountOptions
        inode_reads: InodeReads | None
        _nursery: trio.Nursery | None
        watched: WatchedEntries | None
        prefetch: Prefetcher
        dir_ahead: DirAhead
        list_ahead: ListAhead
        dir_changes: DirChanges
        writeback: WritebackCloses | None
        append_direct: set[int]
        lookups: dict[int, int]
        cached: dict[int, tuple[int, int, int]]
        read_through: dict[int, int]
        kernel_size: dict[int, int]

        def entry(self, attr: Attr) -> pyfuse3.EntryAttributes: ...
        def remember(self, attr: Attr) -> pyfuse3.EntryAttributes: ...
        def file_info(self, fh: int, attr: Attr, flags: int) -> pyfuse3.FileInfo: ...

    def lookup_now(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes | None:
        """LOOKUP answered in libfuse's callback (fuse/fast_answers.py) when
        the mount's caches answer it: a name the cache watch keeps fresh
        (read-write), or a hinted file whose bytes are held (``ro``); None
        leaves it to `lookup`."""
        cached = self._cached_entry(parent_inode, name)
        reads = self.inode_reads
        if reads is not None:
            # cache=immutable: the kernel's pages must be of these attributes
            if cached is None or not reads.current(cached[0]):
                return None
            attr, keep = cached
            return no_longer_than(self.remember(attr), keep)
        if cached is not None:
            return self._found(*cached, parent_inode, name)
        return self._missing() if self._known_absent(parent_inode, name) else None

    def _known_absent(self, parent_inode: int, name: bytes) -> bool:
        """Is *name* known not to be in the directory (read-write: the cache
        watch holds its names, client/cache_watch.py)? The LOOKUP a create
        starts with is then answered with no round trip."""
        watch = self.fs.cache_watch if self.watched is not None else None
        return watch is not None and watch.absent(parent_inode, name)

    def _missing(self) -> pyfuse3.EntryAttributes:
        """A LOOKUP's answer that the name is not there (st_ino 0: the kernel
        keeps that for negative_timeout)."""
        missing = pyfuse3.EntryAttributes()
        missing.st_ino = 0
        missing.entry_timeout = self.options.negative_timeout
        return missing

    def _cached_entry(self, parent_inode: int, name: bytes) -> tuple[Attr, float] | None:
        """A name's attributes from this mount's caches, with no round trip,
        and how long the kernel may keep them at most: a name the cache
        watch keeps fresh (read-write), a hinted file whose bytes are held,
        or a name a listing brought (read-only: fuse/dir_ahead.py for
        files, fuse/list_ahead.py for directories)."""
        if self.watched is not None:
            attr = self.watched.lookup(parent_inode, name)
        elif self.options.read_only:
            attr = self.prefetch.entry_of(parent_inode, name, self.options.entry_timeout)
            if attr is None:
                return self.dir_ahead.lookup(parent_inode, name) or self.list_ahead.lookup(
                    parent_inode, name
                )
        else:
            return None
        return None if attr is None else (attr, math.inf)

    def _found(
        self, attr: Attr, keep: float, parent_inode: int, name: bytes
    ) -> pyfuse3.EntryAttributes:
        entry = no_longer_than(self.remember(attr), keep)
        if self.watched is not None:
            self.watched.extend(entry, parent_inode, name)
        return entry

    def getattr_now(self, inode: int) -> pyfuse3.EntryAttributes | None:
        """GETATTR answered with no round trip (also in libfuse's callback,
        fuse/fast_answers.py), or None."""
        # A create or an unlink makes the kernel drop the directory's cached
        # attributes, and the next lookup, create or unlink in it
        # (permission checks) asks for them again: one metadata round trip
        # per file written into a directory, or removed from it. The
        # change's reply carried them, as fresh as any the kernel caches for
        # attr_timeout; they answer that one getattr.
        fresh = self.dir_changes.replied.pop(inode, None)
        if fresh is not None and fresh[1] > trio.current_time():
            return self.entry(fresh[0])
        if self.watched is not None and (known := self.watched.attributes(inode)) is not None:
            return self.watched.keep(self.entry(known))
        # a file this mount writes: the kernel dropped its attributes at our
        # own writes (chown, chmod, utime after them check permissions again)
        written = self.fs.written_attr(inode, self.options.attr_timeout)
        return None if written is None else self.entry(written)

    def setattr_now(self, inode: int, attrs: OwedAttrs) -> pyfuse3.EntryAttributes | None:
        """A SETATTR (but a size) of a file this writeback mount has open for
        writing, set with its close (client/fs.py); also in libfuse's callback."""
        if self.writeback is None:
            return None
        behind = self.fs.setattr_behind(inode, attrs, self.options.attr_timeout)
        return None if behind is None else self.entry(behind)

    def open_now(self, inode: int, flags: int) -> pyfuse3.FileInfo | None:
        """OPEN answered in libfuse's callback (fuse/fast_answers.py) when it
        needs no round trip: a read-only open the client's open cache
        answers (`FileSystem.open_now`); None leaves it to `open`."""
        if self.inode_reads is not None:
            return None
        hit = self.fs.open_now(inode, flags)
        return None if hit is None else self._opened(hit[0].fh, hit[1], flags)

    def _opened(self, fh: int, attr: Attr, flags: int) -> pyfuse3.FileInfo:
        self.prefetch.opened(attr)
        return self.file_info(fh, attr, flags)

    def handed(self, ino: int, off: int, n: int) -> None:
        """*n* bytes of *ino* at *off* went to the kernel (`read_through`)."""
        through = self.read_through.get(ino, 0)
        if off <= through < off + n:
            self.read_through[ino] = off + n

    def write_now(self, fh: int, off: int, buf: bytes) -> int | None:
        """WRITE answered in libfuse's callback (fuse/fast_answers.py) when
        it goes behind with no wait (`FileSystem.write_now`); None leaves it
        to `write`."""
        f = self.fs.files.get(fh)
        if f is None or fh in self.append_direct or self.options.read_only:
            return None
        n = self.fs.write_now(fh, off, buf)
        if n is not None:
            self._written(f.ino, off + n)
        return n

    def _written(self, ino: int, end: int) -> None:
        self.prefetch.changed(ino)
        # the kernel grows its i_size to the end of the write as it placed it
        self.kernel_size[ino] = max(self.kernel_size.get(ino, 0), end)

    def flush_now(self) -> bool:
        """FLUSH answered in libfuse's callback: a -o writeback mount's,
        whose release does the work behind (`flush`)."""
        return self.writeback is not None and not self.options.read_only

    def release_now(self, fh: int) -> bool:
        """RELEASE answered in libfuse's callback (fuse/fast_answers.py) when
        it needs no round trip and no wait (`FileSystem.release_now`; on a
        -o writeback mount a written handle's, when its close can go
        behind at once); False leaves it to `release`."""
        f = self.fs.files.get(fh)
        if f is None:
            return False
        if f.writable:
            if self.writeback is None or not self.writeback.room():
                return False
            self._released(fh, f.ino, True)
            self.writeback.begin(fh, f.ino)
            return True
        if not self.fs.release_now(fh):
            return False
        self.prefetch.released(f.ino)
        return True

    def _released(self, fh: int, ino: int, writable: bool) -> None:
        self.append_direct.discard(fh)
        if writable:
            self.cached.pop(ino, None)
            self.read_through.pop(ino, None)
        self.prefetch.released(ino)
