"""Longer kernel caching of names and attributes on a read-write mount, for
the files its cache watch keeps fresh (client/cache_watch.py).

A read-write mount tells the kernel to keep names and attributes 1 s
(``entry_timeout``, ``attr_timeout``): after that, every open of a sample
costs a LOOKUP round trip. For a regular file the mount caches under the
watch, though, the metadata server tells the mount of every change to the
file's inode record before the change is acknowledged, and every change that
could make a name of it wrong changes that record: an unlink or a rename
over it (its link count), a rename of it (its ctime). So its LOOKUP reply
may let the kernel keep the name and attributes until the watch's lease
ends, and no longer than the file may stay cached idle (`extend`); once
that has expired, the kernel's next LOOKUP of the name (or GETATTR) is
answered from the mount's cache while the watch still keeps the file fresh
(`lookup`, `attributes`): a loader's epoch longer than the lease then costs
no metadata round trip per sample. When the
mount drops the file from its cache before that (told of a change, a new
watcher), it drops what it told the kernel too (`forget`): the names
asynchronously (pyfuse3 queues them to a thread: a handler may be waiting
on the directory), the attributes at once (attribute invalidation does not
wait on pages). A file that lingers out needs nothing: what the kernel was
told has expired by then (and invalidating its name would make the kernel
evict the inode with its pages).

A directory whose listing the watch keeps (fuse/listings.py) has its LOOKUP
answered the same way while the watch holds it (its attributes are the
watch's; a rename or removal of it changes its inode record), but the
kernel keeps its name no longer than ``entry_timeout``.
"""

from __future__ import annotations

import logging
import stat

import pyfuse3

from shufflefs.client.fs import FileSystem
from shufflefs.metadata.protocol import Attr

log = logging.getLogger("shufflefs.fuse")


class WatchedEntries:
    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.names: dict[int, set[tuple[int, bytes]]] = {}  # what the kernel was told, per inode
        self.by_name: dict[tuple[int, bytes], int] = {}  # the same, by (parent, name)
        # directories whose listing the watch kept when their name was
        # seen: (parent, name) -> (inode, its change counter then). A name
        # is good only while the directory is unchanged since: watched
        # again later (listed under its new name after a rename), its
        # counter is another
        self.dir_names: dict[tuple[int, bytes], tuple[int, int]] = {}
        fs.open_cache.on_forget = self.forget

    def extend(self, entry: pyfuse3.EntryAttributes, parent: int, name: bytes) -> None:
        """A LOOKUP reply: for a regular file the watch keeps fresh, the
        kernel keeps name and attributes until the watch's lease ends."""
        if stat.S_ISDIR(entry.st_mode):
            self.directory(entry.st_ino, parent, name)
            return
        if not stat.S_ISREG(entry.st_mode):
            return
        left = self._longer(entry.st_ino, max(entry.entry_timeout, entry.attr_timeout))
        if left:
            entry.entry_timeout = entry.attr_timeout = left
            self.learn(parent, name, entry.st_ino)

    def listed(
        self,
        parent: int,
        names: list[bytes],
        inos: list[int],
        parents: list[int],
        regular: list[bool],
        timeout: float,
    ) -> list[tuple[int, float]]:
        """`extend` for entries of a listing handed to the kernel as records
        (fuse/kept_listings.py; *parents*: each directory's parent, 0 for a
        file) with *timeout*: the entries (index, timeout) to keep longer."""
        longer = []
        for i, (name, ino, is_dir, is_file) in enumerate(
            zip(names, inos, parents, regular, strict=True)
        ):
            if is_dir:
                self.directory(ino, parent, name)
            elif is_file:
                left = self._longer(ino, timeout)
                if left:
                    longer.append((i, left))
                    self.learn(parent, name, ino)
        return longer

    def _longer(self, ino: int, than: float) -> float:
        """How long the kernel may keep file *ino*'s name and attributes
        when the watch keeps it fresh longer than *than* (else 0)."""
        left = self.fs.open_cache.trusted_for(ino)
        return left if left > than else 0.0

    def learn(self, parent: int, name: bytes, ino: int) -> None:
        """A name of a file the watch keeps fresh, for `lookup` to answer:
        from a LOOKUP reply (`extend`), or from a listing (fuse/dir_ahead.py:
        the kernel was told nothing of it, and a `forget` that invalidates
        it finds no entry)."""
        self.names.setdefault(ino, set()).add((parent, name))
        self.by_name[(parent, name)] = ino

    def directory(self, ino: int, parent: int, name: bytes) -> None:
        """A directory whose listing the watch keeps (told by a LOOKUP reply
        or a listing, or read ahead: fuse/list_ahead.py): its name is as current
        as its attributes (a rename or removal of it changes its inode
        record, and ends the watch), so a later LOOKUP of the name is
        answered from them while the watch holds (the kernel is not told
        to keep the name longer: nothing to drop when the watch ends)."""
        watch = self.fs.cache_watch
        attr = None if watch is None else watch.dir_attr(ino)
        if attr is not None:
            self.dir_names[(parent, name)] = (ino, attr["change"])

    def keep(self, entry: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """A GETATTR reply of such a file: the attributes kept as long."""
        entry.attr_timeout = max(entry.attr_timeout, self.fs.open_cache.trusted_for(entry.st_ino))
        return entry

    def lookup(self, parent: int, name: bytes) -> Attr | None:
        """A LOOKUP of a name `extend` told the kernel, whose file the watch
        still keeps fresh: its attributes, with no round trip (the kernel's
        entry expired with the lease it was given, the watch's lease has
        been renewed since; the name is as current as the attributes: any
        change to it, this mount's own too, is told to the watch)."""
        ino = self.by_name.get((parent, name))
        if ino is not None:
            return self.attributes(ino)
        seen = self.dir_names.get((parent, name))
        watch = self.fs.cache_watch
        if seen is None or watch is None:
            return None
        attr = watch.dir_attr(seen[0])
        if attr is None or attr["change"] != seen[1]:  # changed (renamed, removed...) since
            del self.dir_names[(parent, name)]
            return None
        return attr

    def attributes(self, ino: int) -> Attr | None:
        """The attributes of a file the watch keeps fresh, or of a directory
        whose listing it keeps (None: ask)."""
        if self.fs.open_cache.trusted_for(ino) <= 0:
            watch = self.fs.cache_watch
            return None if watch is None else watch.dir_attr(ino)
        return self.fs.overlay(self.fs.open_cache.entries[ino].attr)

    def forget(self, ino: int, tell: bool) -> None:
        """The mount no longer caches *ino*: no longer kept fresh. *tell*:
        drop what the kernel was told too."""
        names = self.names.pop(ino, None)
        if not names:
            return
        for key in names:
            if self.by_name.get(key) == ino:
                del self.by_name[key]
        if not tell:
            return
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:  # the kernel forgot the inode already
            log.debug("invalidate_inode(%d): %s", ino, exc)
