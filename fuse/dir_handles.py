"""Directory listings of the FUSE mount: the cursor state behind readdir's
offsets, and the '.' and '..' entries."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

import pyfuse3
import trio

from shufflefs.metadata.protocol import Attr

READDIR_PAGE = 256
MAX_CURSORS = 1 << 20  # offsets one directory's cursor state keeps (cache=immutable)


@dataclass
class DirHandle:
    """Where a listing stands: the offsets handed to the kernel (each names
    the entry to resume after) and a fetched page not yet taken. One per
    OPENDIR; on a ``cache=immutable`` mount (no OPENDIR) one per directory
    inode, shared by every listing of it (`ShuffleOps.listing`)."""

    ino: int
    parent: int
    cursors: dict[int, bytes | None] = field(
        default_factory=dict
    )  # next_id -> name to resume after
    pending: list[tuple[bytes, Attr]] = field(default_factory=list)  # fetched, not yet taken
    pending_after: bytes | None = None
    pending_more: bool = False
    age: float = 0.0  # s the page being handed out waited before its listing (list_ahead)
    next_id: int = 3  # 1 and 2 are '.' and '..'
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
