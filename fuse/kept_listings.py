"""Whole directory listings kept by the mount, and READDIRPLUS answered from
them in libfuse's callback.

A listing the kernel caches (``FOPEN_CACHE_DIR``) costs nothing to list
again, until the kernel lets it go: memory pressure, the dentry cache's
aging, a drop of the caches, a mount of many directories. Then every entry
came back through the metadata server (its LMDB reads, about 5 µs of its
CPU an entry) and through the mount's loop (the page decoded, an
``EntryAttributes`` built per entry, pyfuse3's handler and reply: 7-11 µs
of the mount's CPU an entry), and a cold scan of 20,000 names ran at
60,000-100,000 entries/s from one or four processes, where MooseFS does
135,000-259,000.

So once a listing has gone through the mount whole (every page, from the
first), the mount keeps it as the reply the kernel wants: every entry as
its ``struct fuse_direntplus`` record (`record`, the layout libfuse's
``fuse_add_direntry_plus`` writes; tests/fuse/test_kept_listings.py compares
the two), '.' and '..' first, end to end in one buffer. A READDIRPLUS of a
kept directory is then a slice of that buffer (from the offset the kernel
resumes at to the last record its size holds), the kernel's timeouts
written into the slice's records (`KeptListing.stamp`), the mount's
bookkeeping of each entry told (its lookup count and what the kernel knows
of it, as a listing through pyfuse3 does: `ShuffleOps.told_many`) and one
``fuse_reply_buf``: no round trip, no task, no object per entry.

``-o ro`` and ``cache=immutable``: answered from within half of
``min(entry_timeout, attr_timeout)`` of the listing's first page, and the
entries handed out are kept by the kernel that much less (as with a page
read ahead, fuse/list_ahead.py), so a change made elsewhere shows within
those timeouts of the listing, as before; and what it hands out is good
for at least the other half (entries about to expire would send the next
open of each back to the mount as a LOOKUP).

A read-write mount keeps names only, and only while its cache watch keeps
the directory (metadata/cache_watch.py: the server tells the watch of the
directory's next change before that change is acknowledged, this mount's
own changes included): the records carry node id 0 (`name_record`), so the
kernel gets each name, inode number and type, links no entry and caches no
attributes, and a stat after the listing looks the name up as it would
after any listing older than the mode's 1-second timeouts. The watch keeps
names fresh, not a file's attributes (a write elsewhere changes a file, not
its directory), so attributes are never kept in that mode.

Offsets: a kept listing hands out its directory's offsets (`Offsets`, one
set per directory inode), and `Listings` takes the kept listing's set for a
directory it lists again, so a listing the callback began may go on through
pyfuse3 and the other way round.

Bounded by `max_entries` across directories (the mount option
``keep_listings``), the least recently listed dropped first; a directory
larger than a quarter of it is not kept; at most `MAX_GATHERING` listings
are gathered at once (one left unfinished, ``ls | head``, is dropped when
room is needed).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import stat
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING

import numpy as np
import trio

from shufflefs.fuse.dir_handles import Offsets
from shufflefs.fuse.entry_attrs import BLOCK_SIZE
from shufflefs.fuse.prefetch_hints import version_of
from shufflefs.metadata.protocol import Attr

if TYPE_CHECKING:
    from shufflefs.fuse.fast_answers import FastAnswerCounts
    from shufflefs.fuse.libfuse import KernelQueue
    from shufflefs.fuse.ops import ShuffleOps

log = logging.getLogger("shufflefs.fuse")

DEFAULT_ENTRIES = 1 << 17  # entries kept across directories (keep_listings=): ~500 bytes each
MAX_ENTRIES = 1 << 24
MAX_GATHERING = 64  # listings gathered at once (the oldest unfinished one dropped)
# struct fuse_entry_out (nodeid, generation, entry_valid, attr_valid, their
# nsecs, struct fuse_attr), then struct fuse_dirent without its name
# (ino, off, namelen, type): FUSE_NAME_OFFSET_DIRENTPLUS bytes
DIRENTPLUS = struct.Struct("<QQQQIIQQQQQQIIIIIIIIIIQQII")
assert DIRENTPLUS.size == 152  # FUSE_NAME_OFFSET_DIRENTPLUS
# 64-bit words into a record: entry_valid, attr_valid, then both nsecs in one
ENTRY_VALID, ATTR_VALID, VALID_NSECS = 2, 3, 4
NS = 1_000_000_000


def record(
    name: bytes, attr: Attr, cookie: int, entry_timeout: float, attr_timeout: float
) -> bytes:
    """*attr*'s entry named *name* as READDIRPLUS carries it (what libfuse's
    ``fuse_add_direntry_plus`` writes for pyfuse3's ``EntryAttributes``:
    fuse/entry_attrs.py), resuming after it at *cookie*."""
    ino, mode, size = attr["ino"], attr["mode"], attr["size"]
    at, mt, ct = attr["atime"], attr["mtime"], attr["ctime"]
    e_sec, e_nsec = _timeout(entry_timeout)
    a_sec, a_nsec = _timeout(attr_timeout)
    head = DIRENTPLUS.pack(
        ino, 0, e_sec, a_sec, e_nsec, a_nsec,
        ino, size, (size + 511) // 512, at // NS, mt // NS, ct // NS,
        at % NS, mt % NS, ct % NS, mode, attr["nlink"], attr["uid"], attr["gid"],
        attr["rdev"], BLOCK_SIZE, 0,
        ino, cookie, len(name), stat.S_IFMT(mode) >> 12,
    )  # fmt: skip
    return head + name + bytes(-len(name) % 8)


def name_record(name: bytes, ino: int, mode: int, cookie: int) -> bytes:
    """*name*'s entry with no attributes (node id 0: the kernel links no
    entry and takes no reference; a listing gets the name, inode number and
    type, a stat then looks the name up)."""
    head = DIRENTPLUS.pack(*(0,) * 22, ino, cookie, len(name), stat.S_IFMT(mode) >> 12)
    return head + name + bytes(-len(name) % 8)


def dot_record(name: bytes, ino: int, cookie: int) -> bytes:
    """'.' or '..' (the kernel takes only the inode: fuse/dir_handles.py,
    `dot_entry`)."""
    zero = ("size", "atime", "mtime", "ctime", "uid", "gid", "rdev")
    attr = {**dict.fromkeys(zero, 0), "ino": ino, "mode": stat.S_IFDIR, "nlink": 1}
    return record(name, attr, cookie, 0.0, 0.0)  # type: ignore[arg-type]


def _timeout(seconds: float) -> tuple[int, int]:
    """libfuse's split of a timeout (calc_timeout_sec/nsec)."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


@dataclass(eq=False)
class KeptListing:
    """One directory's listing, kept whole: records 0 and 1 are '.' and
    '..', record 2 + i the directory's entry i."""

    ino: int
    read_at: float  # trio time of its first page's read
    offsets: Offsets
    records: bytearray
    starts: list[int]  # byte offset of each record, and the end
    resume: dict[int, int]  # an offset the kernel resumes at -> the record after it
    inos: list[int]  # of entry i
    versions: list[tuple[int, int, int]]
    parents: list[int]  # attr["parent"] of entry i (0 for a file)
    regular: list[bool]
    with_attrs: bool = True  # else names only (read-write: `name_record`)
    change: int = 0  # read-write: the directory's change counter it was listed at
    _address: int = 0
    _view: ctypes.Array[ctypes.c_char] | None = None
    _words: np.ndarray | None = None  # the records as 64-bit words
    _entry_words: np.ndarray | None = None  # word index of entry i's record

    def __post_init__(self) -> None:
        self._view = (ctypes.c_char * len(self.records)).from_buffer(self.records)
        self._address = ctypes.addressof(self._view)
        self._words = np.frombuffer(self.records, dtype="<u8")
        self._entry_words = np.array(self.starts[2:-1], dtype=np.int64) // 8

    def __len__(self) -> int:
        return len(self.inos)

    def span(self, off: int, size: int) -> tuple[int, int] | None:
        """The records a READDIRPLUS at offset *off* of *size* bytes gets
        (first, past the last), or None for an offset not handed out here."""
        first = off if off <= 2 else self.resume.get(off)
        if first is None:
            return None
        starts = self.starts
        last = bisect.bisect_right(starts, starts[first] + size, first) - 1
        return first, max(first, min(last, len(starts) - 1))

    def stamp(self, lo: int, hi: int, entry_timeout: float, attr_timeout: float) -> None:
        """Write the kernel's timeouts into entries *lo*..*hi*-1."""
        assert self._words is not None and self._entry_words is not None
        if hi <= lo:
            return
        at = self._entry_words[lo:hi]
        e_sec, e_nsec = _timeout(entry_timeout)
        a_sec, a_nsec = _timeout(attr_timeout)
        words = self._words
        words[at + ENTRY_VALID] = e_sec
        words[at + ATTR_VALID] = a_sec
        words[at + VALID_NSECS] = e_nsec | (a_nsec << 32)

    def address(self, first: int) -> int:
        return self._address + self.starts[first]


def keep(
    ino: int,
    parent: int,
    read_at: float,
    offsets: Offsets,
    entries: Sequence[tuple[bytes, Attr]],
    change: int | None = None,
) -> KeptListing:
    """The listing *entries* of directory *ino* (its first page read at
    *read_at*), as kept (timeouts written when handed out); with a *change*
    counter (read-write), names only."""
    parts = [dot_record(b".", ino, 1), dot_record(b"..", parent, 2)]
    starts = [0, len(parts[0]), len(parts[0]) + len(parts[1])]
    resume = {}
    of, end = offsets.of, starts[-1]
    for i, (name, attr) in enumerate(entries):
        cookie = of(name)
        if change is None:
            part = record(name, attr, cookie, 0.0, 0.0)
        else:
            part = name_record(name, attr["ino"], attr["mode"], cookie)
        parts.append(part)
        end += len(part)
        starts.append(end)
        resume[cookie] = i + 3
    return KeptListing(
        ino,
        read_at,
        offsets,
        bytearray(b"".join(parts)),
        starts,
        resume,
        [a["ino"] for _, a in entries],
        [version_of(a) for _, a in entries],
        [a["parent"] for _, a in entries],
        [stat.S_ISREG(a["mode"]) for _, a in entries],
        change is None,
        change or 0,
    )


@dataclass(eq=False)
class Gathering:
    """A listing of one directory going through pyfuse3 from its first
    page, its pages gathered to be kept once the last is in."""

    read_at: float
    change: int | None  # read-write: the directory's change counter at its first page
    entries: list[tuple[bytes, Attr]] = field(default_factory=list)
    after: bytes | None = None  # the last name gathered (the next page must follow it)


class KeptListings:
    """The mount's kept listings (see the module's docstring)."""

    def __init__(self, ops: ShuffleOps, max_entries: int) -> None:
        self.ops = ops
        # read-write: names only, while the cache watch keeps the directory
        self.watch = None if ops.options.read_only else ops.fs.cache_watch
        keeps = ops.options.read_only or self.watch is not None
        self.max_entries = max_entries if keeps else 0
        # answered from for half the mode's timeouts: what it hands the kernel
        # is then good for at least the other half (entries that expire at
        # once would send every next open back to the mount as a LOOKUP)
        self.fresh_for = min(ops.options.entry_timeout, ops.options.attr_timeout) / 2
        self.kept: OrderedDict[int, KeptListing] = OrderedDict()
        self.entries = 0
        self.gathering: dict[int, Gathering] = {}
        self.queue: KernelQueue | None = None
        self.counts: FastAnswerCounts | None = None

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def fresh(self, ino: int) -> bool:
        return self.current(ino) is not None

    def current(self, ino: int) -> KeptListing | None:
        """Directory *ino*'s kept listing, if still fresh."""
        kept = self.kept.get(ino)
        if kept is None:
            return None
        if self.watch is not None:
            fresh = self._watched_change(ino) == kept.change
        else:
            fresh = trio.current_time() - kept.read_at < self.fresh_for
        if not fresh:
            self._drop(ino)
            return None
        return kept

    def _watched_change(self, ino: int) -> int | None:
        """Read-write: the change counter the watch holds directory *ino* at
        (None: not watched)."""
        attr = None if self.watch is None else self.watch.dir_attr(ino)
        return None if attr is None else attr["change"]

    # ---- gathered from listings through pyfuse3 (fuse/listings.py) --------------

    def page(
        self,
        ino: int,
        parent: int,
        after: bytes | None,
        entries: list[tuple[bytes, Attr]],
        more: bool,
        age: float,
        offsets: Offsets,
    ) -> None:
        """A page of directory *ino*'s listing after *after* was read
        (*age* seconds ago), *more* after it."""
        if not self.enabled:
            return
        if after is None:
            self.gathering.pop(ino, None)
            while len(self.gathering) >= MAX_GATHERING:  # listings left unfinished
                del self.gathering[next(iter(self.gathering))]
            change = self._watched_change(ino)
            if self.watch is not None and change is None:
                return  # not watched: nothing would say when it changes
            g = self.gathering[ino] = Gathering(trio.current_time() - age, change)
        else:
            g = self.gathering.get(ino)  # type: ignore[assignment]
            if g is None or g.after != after:  # not from the first page, or another listing's
                return
            g.read_at = min(g.read_at, trio.current_time() - age)
        g.entries.extend(entries)
        if len(g.entries) > self.max_entries // 4:
            del self.gathering[ino]
            return
        if entries:
            g.after = entries[-1][0]
        if more and entries:
            return
        del self.gathering[ino]
        if self.watch is not None:
            if self._watched_change(ino) == g.change:  # unchanged since its first page
                self._add(keep(ino, parent, g.read_at, offsets, g.entries, g.change))
        elif trio.current_time() - g.read_at < self.fresh_for:
            self._add(keep(ino, parent, g.read_at, offsets, g.entries))

    def _add(self, kept: KeptListing) -> None:
        self._drop(kept.ino)
        self.kept[kept.ino] = kept
        self.entries += len(kept)
        while self.entries > self.max_entries and len(self.kept) > 1:
            self._drop(next(iter(self.kept)))

    def _drop(self, ino: int) -> None:
        kept = self.kept.pop(ino, None)
        if kept is not None:
            self.entries -= len(kept)

    # ---- READDIRPLUS in libfuse's callback (fuse/read_inode.py) ----------------

    def install(self, queue: KernelQueue, counts: FastAnswerCounts) -> None:
        self.queue, self.counts = queue, counts

    def readdirplus(self, req: int, ino: int, size: int, off: int, fi: int) -> bool:
        """Answer a READDIRPLUS from directory *ino*'s kept listing (True),
        or decline it (nothing done)."""
        queue = self.queue
        if queue is None:
            return False
        try:
            answered = self._answer(queue, req, ino, size, off)
        except Exception:
            log.exception("READDIRPLUS of directory %d from its kept listing", ino)
            self._drop(ino)
            answered = False
        queue.answered(answered)
        return answered

    def _answer(self, queue: KernelQueue, req: int, ino: int, size: int, off: int) -> bool:
        kept = self.current(ino)
        if kept is None:
            return False
        span = kept.span(off, size)
        if span is None:
            return False
        first, last = span
        self.kept.move_to_end(ino)
        ops = self.ops
        ops.listings.offsets.setdefault(ino, kept.offsets)
        if first == 0:  # a listing from its start: its files' first opens open it ahead
            ops.dir_ahead.listed_files(ino, list(compress(kept.inos, kept.regular)))
        if kept.with_attrs:
            lo, hi = max(first, 2) - 2, max(last, 2) - 2  # the entries among the records
            age = trio.current_time() - kept.read_at  # (under fresh_for: both stay positive)
            kept.stamp(lo, hi, ops.options.entry_timeout - age, ops.options.attr_timeout - age)
            ops.told_many(
                kept.inos[lo:hi], kept.versions[lo:hi], kept.parents[lo:hi], kept.regular[lo:hi]
            )
        nbytes = kept.starts[last] - kept.starts[first]
        queue.libfuse.reply_buf(req, kept.address(first), nbytes)
        if self.counts is not None:
            self.counts.listing += 1
        return True
