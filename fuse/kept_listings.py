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

So every page of a listing read through the mount is built once into the
reply the kernel wants: every entry as its ``struct fuse_direntplus``
record (fuse/direntplus.py), '.' and '..' first, end to end. A READDIRPLUS
is then a slice of those records (from the offset the kernel resumes at to
the last record its size holds), the kernel's timeouts written into the
slice's records (`Records.stamp`), the mount's bookkeeping of each entry
told (its lookup count and what the kernel knows of it, as a listing entry
by entry does: `ShuffleOps.told_many`, and on a read-write mount
`WatchedEntries.listed`) and one reply: no object per entry.

* While a listing is read (`Gathering`), the pages read so far answer the
  READDIRPLUS requests that resume inside them in libfuse's callback (no
  task on pyfuse3's loop); the one that needs the next page goes to
  pyfuse3's handler (fuse/listings.py), which reads the page and writes its
  records into pyfuse3's reply in one piece (`into_reply`,
  fuse/readdir_token.py), not entry by entry. One process's first scan of
  20,000 names in 100 directories took 10.5-15.5 µs of the mount's CPU an
  entry entry by entry.
* Once a listing has gone through the mount whole (every page, from the
  first), the mount keeps it (`kept`), and answers the kernel's next
  listings of the directory from it in the callback, with no round trip.

``-o ro`` and ``cache=immutable``: answered from within half of
``min(entry_timeout, attr_timeout)`` of the page's read (for a kept listing,
of its first page's), and the entries handed out are kept by the kernel that
much less (as with a page read ahead, fuse/list_ahead.py), so a change made
elsewhere shows within those timeouts of the listing, as before; and what it
hands out is good for at least the other half (entries about to expire
would send the next open of each back to the mount as a LOOKUP).

A read-write mount keeps a listing only while its cache watch keeps the
directory (metadata/cache_watch.py: the server tells the watch of the
directory's next change before that change is acknowledged, this mount's
own changes included), and hands out attributes only to the listing that
read them, within half the mode's timeouts, as entry by entry: any other
listing of it gets names only (`Records.strip`: node id 0, so the kernel
gets each name, inode number and type, links no entry and caches no
attributes, and a stat after the listing looks the name up as it would
after any listing older than the mode's 1-second timeouts). The watch keeps
names fresh, not a file's attributes (a chmod or a write changes a file, not
its directory).

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

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING

import pyfuse3
import trio

from shufflefs.fuse import readdir_token
from shufflefs.fuse.dir_handles import Offsets
from shufflefs.fuse.direntplus import Records, build, join
from shufflefs.metadata.protocol import Attr

if TYPE_CHECKING:
    from shufflefs.fuse.fast_answers import FastAnswerCounts
    from shufflefs.fuse.libfuse import KernelQueue
    from shufflefs.fuse.ops import ShuffleOps

log = logging.getLogger("shufflefs.fuse")

DEFAULT_ENTRIES = 1 << 17  # entries kept across directories (keep_listings=): ~500 bytes each
MAX_ENTRIES = 1 << 24
MAX_GATHERING = 64  # listings gathered at once (the oldest unfinished one dropped)


@dataclass(eq=False)
class Gathering:
    """A listing of one directory going through the mount from its first
    page: the records of its pages so far, kept whole once the last is in."""

    change: int | None  # read-write: the directory's change counter at its first page
    parts: list[Records] = field(default_factory=list)  # one per page, in order
    at: dict[int, int] = field(default_factory=dict)  # an offset handed out -> its part
    entries: int = 0

    @property
    def after(self) -> bytes | None:
        """The last name gathered (the next page must follow it)."""
        return next((part.names[-1] for part in reversed(self.parts) if part.names), None)


class KeptListings:
    """The mount's kept listings (see the module's docstring)."""

    def __init__(self, ops: ShuffleOps, max_entries: int) -> None:
        self.ops = ops
        # read-write: while the cache watch keeps the directory
        self.watch = None if ops.options.read_only else ops.fs.cache_watch
        keeps = ops.options.read_only or self.watch is not None
        self.max_entries = max_entries if keeps else 0
        # attributes handed out for half the mode's timeouts: they are then
        # good for at least the other half (entries that expire at once would
        # send every next open back to the mount as a LOOKUP)
        self.fresh_for = min(ops.options.entry_timeout, ops.options.attr_timeout) / 2
        self.kept: OrderedDict[int, Records] = OrderedDict()
        self.entries = 0
        self.gathering: dict[int, Gathering] = {}
        self.queue: KernelQueue | None = None
        self.counts: FastAnswerCounts | None = None
        # pyfuse3's reply to a READDIRPLUS written in one piece (else entry by entry)
        self.into_replies = self.enabled and readdir_token.layout_ok()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def fresh(self, ino: int) -> bool:
        return self.current(ino) is not None

    def current(self, ino: int) -> Records | None:
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

    # ---- pages of listings through pyfuse3 (fuse/listings.py) -------------------

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
        (*age* seconds ago), *more* after it: its records are built."""
        if not self.enabled:
            return
        if after is None:
            self.gathering.pop(ino, None)
            while len(self.gathering) >= MAX_GATHERING:  # listings left unfinished
                del self.gathering[next(iter(self.gathering))]
            change = self._watched_change(ino)
            if self.watch is not None and change is None:
                return  # not watched: nothing would say when it changes
            g = self.gathering[ino] = Gathering(change)
        else:
            g = self.gathering.get(ino)  # type: ignore[assignment]
            if g is None or g.after != after:  # not from the first page, or another listing's
                return
        if g.entries + len(entries) > self.max_entries // 4:
            del self.gathering[ino]
            return
        now = trio.current_time()
        part = build(ino, parent if after is None else None, now - age, offsets, entries)
        g.at.update(dict.fromkeys(part.resume, len(g.parts)))
        g.parts.append(part)
        g.entries += len(entries)
        if more and entries:
            return
        del self.gathering[ino]
        if self.watch is not None and self._watched_change(ino) != g.change:
            return  # changed since its first page
        kept = join(g.parts)
        kept.change = g.change or 0
        if self.watch is not None or now - kept.read_at < self.fresh_for:
            self._add(kept)

    def _add(self, kept: Records) -> None:
        self._drop(kept.ino)
        self.kept[kept.ino] = kept
        self.entries += len(kept)
        while self.entries > self.max_entries and len(self.kept) > 1:
            self._drop(next(iter(self.kept)))

    def _drop(self, ino: int) -> None:
        kept = self.kept.pop(ino, None)
        if kept is not None:
            self.entries -= len(kept)

    # ---- what a READDIRPLUS gets ------------------------------------------------

    def locate(
        self, ino: int, off: int, size: int, told: bool = False
    ) -> tuple[Records, int, int, bool] | None:
        """The records a READDIRPLUS of directory *ino* at offset *off* of
        *size* bytes gets: (records, first, past the last, whether they are
        the whole listing's); None when the mount has none to give (not
        listed, not fresh, or the page after *off* not read yet). From the
        whole listing, an empty span is the listing's end. *told*: the
        listing asking read its page just now."""
        kept = self.current(ino)
        if kept is not None:
            span = kept.span(off, size)
            if span is None or (span[0] == span[1] != kept.end):  # (none fits: not the end)
                return None
            return (kept, *span, True)
        g = self.gathering.get(ino)
        if g is None or not g.parts or self._watched_change(ino) != g.change:
            return None
        if off <= 2 and not told and self.watch is not None:
            return None  # read-write: a listing from the start reads its attributes afresh
        i = 0 if off <= 2 else g.at.get(off)
        if i is None:
            return None
        part = g.parts[i]
        first = off if off <= 2 else part.resume[off]
        if first == part.end:  # after a page's last entry: the next page's first
            if i + 1 == len(g.parts):
                return None
            part, first = g.parts[i + 1], 0
        if trio.current_time() - part.read_at >= self.fresh_for:
            return None
        first, last = part.span_from(first, size)
        return None if last == first else (part, first, last, False)

    def _serve(
        self, records: Records, first: int, last: int, whole: bool, told: bool = False
    ) -> tuple[int, int]:
        """Records *first*..*last*-1 handed to the kernel: the timeouts
        written into them, the mount's bookkeeping of each entry told (as
        `ShuffleOps.entry` and, read-write, `WatchedEntries.extend` do for
        an entry through pyfuse3). Their address and length. *told*: the
        listing read their page just now (and told `dir_ahead` of it)."""
        ops, ino = self.ops, records.ino
        ops.listings.offsets.setdefault(ino, records.offsets)
        lo, hi = records.entries(first, last)
        age = trio.current_time() - records.read_at
        if whole:
            self.kept.move_to_end(ino)
            if first == 0 and not told:
                # a listing from its start: its files' first opens open it ahead
                ops.dir_ahead.listed_files(ino, list(compress(records.inos, records.regular)))
            # read-write: the attributes only to the listing that read them,
            # and not for long (the watch keeps names fresh, not a file's
            # attributes: a chmod changes a file, not its directory)
            stale = (first <= 2 and not told) or age >= self.fresh_for
            if self.watch is not None and records.with_attrs and stale:
                records.strip()
        if records.with_attrs and hi > lo:
            options = ops.options
            entry_timeout, attr_timeout = options.entry_timeout - age, options.attr_timeout - age
            records.stamp(lo, hi, entry_timeout, attr_timeout)
            ops.told_many(
                records.inos[lo:hi],
                records.versions[lo:hi],
                records.parents[lo:hi],
                records.regular[lo:hi],
            )
            if ops.watched is not None:
                longer = ops.watched.listed(
                    ino,
                    records.names[lo:hi],
                    records.inos[lo:hi],
                    records.parents[lo:hi],
                    records.regular[lo:hi],
                    max(entry_timeout, attr_timeout),
                )
                for i, keep in longer:
                    records.stamp(lo + i, lo + i + 1, keep, keep)
        return records.address(first), records.starts[last] - records.starts[first]

    def into_reply(self, ino: int, off: int, token: pyfuse3.ReaddirToken, told: bool) -> bool:
        """Write the records after offset *off* of directory *ino* into
        pyfuse3's reply to a READDIRPLUS (True), or nothing (False: not
        there; the listing goes on entry by entry). *told*: the page they
        come from was just read for this listing (`dir_ahead` knows it)."""
        if not self.into_replies:
            return False
        room = readdir_token.room(token)
        found = self.locate(ino, off, room, told)
        if found is None:
            return False
        records, first, last, whole = found
        address, nbytes = self._serve(records, first, last, whole, told)
        readdir_token.write(token, address, nbytes)
        return True

    # ---- READDIRPLUS in libfuse's callback (fuse/read_inode.py) ----------------

    def install(self, queue: KernelQueue, counts: FastAnswerCounts) -> None:
        self.queue, self.counts = queue, counts

    def readdirplus(self, req: int, ino: int, size: int, off: int, fi: int) -> bool:
        """Answer a READDIRPLUS of directory *ino* from the records the mount
        holds (True), or decline it (nothing done)."""
        queue = self.queue
        if queue is None:
            return False
        try:
            answered = self._answer(queue, req, ino, size, off)
        except Exception:
            log.exception("READDIRPLUS of directory %d from its kept listing", ino)
            self._drop(ino)
            self.gathering.pop(ino, None)
            answered = False
        queue.answered(answered)
        return answered

    def _answer(self, queue: KernelQueue, req: int, ino: int, size: int, off: int) -> bool:
        found = self.locate(ino, off, size)
        if found is None:
            return False
        address, nbytes = self._serve(*found)
        queue.libfuse.reply_buf(req, address, nbytes)
        if self.counts is not None:
            self.counts.listing += 1
        return True
