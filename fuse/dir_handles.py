"""Directory listings of the FUSE mount: the cursor state behind readdir's
offsets, and the '.' and '..' entries."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

import pyfuse3
import trio

from shufflefs.metadata.protocol import Attr

READDIR_PAGE = 256
MAX_CURSORS = 1 << 20  # names one directory's offsets remember, at most


@dataclass(eq=False)
class Offsets:
    """The offsets a directory's listings hand the kernel, each naming the
    entry to resume after: one set per directory inode, shared by all its
    listings, in every mount mode.

    Not one per OPENDIR: the kernel keeps a listing in its page cache
    (``FOPEN_CACHE_DIR``) across opens, with the offsets of the listing
    that filled it; when it loses a page of it (memory pressure), it drops
    the rest and goes on *uncached* from the offset it stood at, under
    whichever handle is reading now. Offsets known only to the handle
    that made them made that READDIRPLUS fail (EINVAL: an ``ls`` of a large
    directory on a busy node). A name keeps its offset for as long as the
    kernel holds the directory (dropped at its FORGET), so that listing a
    directory again adds nothing; past `MAX_CURSORS` names the set starts
    over (numbers are never reused: an offset from before is refused as
    stale, never taken for another name)."""

    names: dict[int, bytes] = field(default_factory=dict)  # offset -> name to resume after
    ids: dict[bytes, int] = field(default_factory=dict)  # name -> its offset
    next_id: int = 3  # 1 and 2 are '.' and '..'

    def of(self, name: bytes) -> int:
        """The offset that resumes a listing after *name*."""
        off = self.ids.get(name)
        if off is None:
            if len(self.ids) >= MAX_CURSORS:
                self.names.clear()
                self.ids.clear()
            off = self.ids[name] = self.next_id
            self.names[off] = name
            self.next_id += 1
        return off


@dataclass
class DirHandle:
    """Where a listing stands: its directory's offsets (`Offsets`) and a
    fetched page not yet taken. One per OPENDIR; on a ``cache=immutable``
    mount (no OPENDIR) one per directory inode, shared by every listing of
    it (`Listings.listing`)."""

    ino: int
    parent: int
    offsets: Offsets = field(default_factory=Offsets)
    pending: list[tuple[bytes, Attr]] = field(default_factory=list)  # fetched, not yet taken
    pending_after: bytes | None = None
    pending_more: bool = False
    age: float = 0.0  # s the page being handed out waited before its listing (list_ahead)
    # this listing's last page said "no more" after this entry (None: an
    # empty directory): the kernel's next READDIR, from there, is answered
    # with the end at once instead of a round trip for an empty page
    # (entries made since the listing started need not appear, POSIX)
    end_after: bytes | None = None
    ended: bool = False
    # the page after the name `ahead_after`, being read while the kernel
    # takes the one before it (`Listings._read_next`): `ahead_done` is set
    # when the read ended, `ahead_page` (entries, more, when it was read)
    # if it brought one
    ahead_after: bytes | None = None
    ahead_done: trio.Event | None = None
    ahead_page: tuple[list[tuple[bytes, Attr]], bool, float] | None = None


def dot_entry(ino: int) -> pyfuse3.EntryAttributes:
    """'.' or '..' in a listing: the kernel takes only the inode number
    (it links no entry and caches no attributes for them), so no round
    trip for their attributes."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = ino
    e.st_mode = stat.S_IFDIR
    e.entry_timeout = 0
    e.attr_timeout = 0
    return e
