"""Prefetch hints: what a ``setxattr`` value says (`parse_hint`) and the
inodes its paths name (`HintResolver`), and the versions and layouts of the
files one read takes (`open_ahead`), for fuse/prefetch.py, which queues,
fetches and serves them (the interface is described there and in
docs/training-data.md, "Prefetch through the mount").

Paths are resolved by a listing of their directory (`readdir` as rows: one
request per directory and page instead of a lookup and an open per file),
kept LISTING_TTL, then kept again for as long as one `resolve` of the
directory finds its change counter where it was (no name came, went or was
replaced since: every such change raises it); a name the listing lacks (new
since, or not a regular file) is looked up, as are the names of a directory
there was no room to list (`HintResolver._room`). Listing again on every
expiry cost a mount of 20,000 hinted files 300 ms of CPU every 30 s, and a
dataset larger than the bound its whole listing again and again. A kept
listing may be stale: the fetch opens every file before reading it (a file
removed since is left out, a changed one read at its current version), and
an open that sees another version drops the fetched bytes
(`Prefetcher.opened`).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import posixpath
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shufflefs.client.fs import FileSystem
from shufflefs.metadata.listing_rows import ATTR_ROW
from shufflefs.metadata.protocol import READDIR_MAX, Attr, Layout
from shufflefs.rpc.errors import FsError, first_fs_error

PREFETCH_XATTR = b"user.shufflefs.prefetch"  # the hint interface (docs/training-data.md)
QUEUED = b"queued"  # a hinting getxattr's value: taken
HELD = b"held"  # ... every hinted file is in the kernel's page cache already (a warm epoch)
MAX_HINT_ITEMS = 8192  # per setxattr (the kernel caps a value at 64 KiB anyway)
MAX_PARALLEL_RESOLVES = 64
LISTING_TTL = 30.0  # s a directory listing is kept to resolve hinted names
MAX_LISTED = 1 << 20  # names kept over all listings (about 300 MB; those under way may pass it)
PAGE = 4096

Version = tuple[int, int, int]  # (size, mtime, ctime): what close-to-open compares
# where a listing row (metadata/listing_rows.py: the name, then ATTR_ROW) has them
INO_AT, MODE_AT, SIZE_AT, MTIME_AT, CTIME_AT = (
    1 + ATTR_ROW.index(key) for key in ("ino", "mode", "size", "mtime", "ctime")
)


def version_of(attr: Attr) -> Version:
    return (attr["size"], attr["mtime"], attr["ctime"])


@dataclass
class Hint:
    ino: int
    offset: int
    length: int | None  # None: to the end of the file
    name: tuple[int, bytes] | None = None  # (parent inode, name) when hinted by path
    version: Version | None = None  # as listed or looked up
    at: float = 0.0  # time.monotonic() when queued: a READ of the file after it makes it late


Listed = tuple[int, int, int, int]  # a listed file: (ino, size, mtime, ctime)


@dataclass
class Listing:
    """A directory's files as its listing gave them, kept LISTING_TTL from
    when it was listed or last found unchanged. Only what resolving a name
    needs (the fetch opens its files and reads by the layouts the opens
    give): 300 bytes a name, where the whole attributes and layout were 630."""

    ino: int
    listed_at: float  # when listed, or last found unchanged (`HintResolver.listing`)
    files: dict[bytes, Listed]
    change: int = -1  # the directory's change counter when listed
    used_at: float = 0.0
    whole: bool = True  # False: not listed for want of room; its names are looked up


def parse_hint(value: bytes) -> list[tuple[bytes, int, int | None]]:
    """(path, offset, length) items of a setxattr value; EINVAL/E2BIG."""
    text = value.strip()
    items: list[tuple[bytes, int, int | None]] = []
    if text.startswith(b"["):
        try:
            decoded = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FsError(errno.EINVAL, f"prefetch hint: not JSON ({exc})") from None
        if len(decoded) > MAX_HINT_ITEMS:
            raise FsError(errno.E2BIG, f"prefetch hint: over {MAX_HINT_ITEMS} items")
        for item in decoded:
            if isinstance(item, str):
                items.append((os.fsencode(item), 0, None))
            elif (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and all(type(x) is int for x in item[1:])
                and item[1] >= 0
                and item[2] >= 0
            ):
                items.append((os.fsencode(item[0]), item[1], item[2]))
            else:
                raise FsError(
                    errno.EINVAL, f"prefetch hint: {item!r} is not a path or [path, offset, length]"
                )
    else:
        lines = [line for line in text.split(b"\n") if line.strip()]
        if len(lines) > MAX_HINT_ITEMS:
            raise FsError(errno.E2BIG, f"prefetch hint: over {MAX_HINT_ITEMS} items")
        items = [(line.rstrip(b"\r"), 0, None) for line in lines]
    for path, _, _ in items:
        if not path or b"\0" in path:
            raise FsError(errno.EINVAL, "prefetch hint: an empty path or a NUL in a path")
    return items


@dataclass
class HintResolver:
    """Hinted paths to inodes, with the directory listings kept for it."""

    fs: FileSystem
    listings: OrderedDict[bytes, Listing] = field(default_factory=OrderedDict)  # dir path ->
    listed: int = 0  # names in listings
    listings_made: int = 0  # directories listed (again: their change counter moved)
    revalidated: int = 0  # expired listings found unchanged and kept
    unlisted: int = 0  # directories not listed for want of room (names looked up)
    _busy: dict[bytes, trio.Event] = field(default_factory=dict)  # listings under way
    _listing_now: int = 0  # directories being listed

    async def resolve(self, items: list[tuple[bytes, int, int | None]]) -> list[Hint]:
        """Every path to an inode, by a listing of its directory (`listing`),
        or a lookup for a name the listing lacks (all names of a directory
        not listed for want of room); the first failure (ENOENT, ENOTDIR,
        EISDIR...) fails the whole batch."""
        split = []
        for path, off, length in items:
            head, name = posixpath.split(posixpath.normpath(b"/" + path))
            if not name:
                raise FsError(errno.EISDIR, "prefetch hint: the mount root is a directory")
            split.append((head, name, off, length))
        listings: dict[bytes, Listing] = {}

        async def list_one(head: bytes) -> None:
            listings[head] = await self.listing(head)

        # (expired listings each ask the metadata server: at once)
        await all_or_first_error(
            [functools.partial(list_one, head) for head in dict.fromkeys(h for h, *_ in split)]
        )
        hints = []
        limit = trio.CapacityLimiter(MAX_PARALLEL_RESOLVES)
        looked_up: dict[tuple[int, bytes], Attr] = {}
        missing = {
            (listings[head].ino, name)
            for head, name, _, _ in split
            if name not in listings[head].files
        }

        async def lookup(parent: int, name: bytes) -> None:
            async with limit:
                try:
                    looked_up[(parent, name)] = await self.fs.lookup(parent, name)
                except FsError as exc:
                    raise FsError(exc.code, f"prefetch hint: {exc.message}") from None

        # names new since the listing, not regular files, absent, or of a
        # directory not listed
        await all_or_first_error([functools.partial(lookup, *key) for key in missing])
        for head, name, off, length in split:
            listing = listings[head]
            key = (listing.ino, name)
            if key in looked_up:
                attr = looked_up[key]
                if not stat.S_ISREG(attr["mode"]):
                    shown = os.fsdecode(posixpath.join(head, name))
                    raise FsError(errno.EISDIR, f"prefetch hint: {shown} is not a regular file")
                hints.append(Hint(attr["ino"], off, length, key, version=version_of(attr)))
            else:
                ino, size, mtime, ctime = listing.files[name]
                hints.append(Hint(ino, off, length, key, (size, mtime, ctime)))
        return hints

    async def listing(self, head: bytes) -> Listing:
        """*head*'s listing, kept or made (one at a time per directory: the
        first hints of several readers name the same directories at once)."""
        while (busy := self._busy.get(head)) is not None:
            await busy.wait()
        now = trio.current_time()
        kept = self.listings.get(head)
        if kept is not None and now - kept.listed_at < LISTING_TTL:
            kept.used_at = now
            self.listings.move_to_end(head)  # (the least recently used go first)
            return kept
        done = self._busy[head] = trio.Event()
        try:
            return await self._listing(head, now, kept)
        finally:
            del self._busy[head]
            done.set()

    async def _listing(self, head: bytes, now: float, kept: Listing | None) -> Listing:
        attr = await self.fs.resolve(head)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, f"prefetch hint: {os.fsdecode(head)} not a directory")
        current = (attr["ino"], attr["change"])
        if kept is not None and kept.whole and (kept.ino, kept.change) == current:
            kept.listed_at = kept.used_at = now  # its names are as they were (the files'
            # versions may not be: each fetch opens its files first, `Prefetcher._fetch`)
            self.revalidated += 1
            self._keep(head, kept)
            return kept
        if not self._room(now):
            listing = Listing(attr["ino"], now, {}, attr["change"], now, whole=False)
            self.unlisted += 1
            self._keep(head, listing)
            return listing
        self._listing_now += 1
        try:
            files = await self._files(attr["ino"])
        finally:
            self._listing_now -= 1
        listing = Listing(attr["ino"], now, files, attr["change"], now)
        self.listings_made += 1
        self._keep(head, listing)
        return listing

    async def _files(self, ino: int) -> dict[bytes, Listed]:
        """Directory *ino*'s regular files, page by page."""
        files: dict[bytes, Listed] = {}
        after: bytes | None = None
        while True:
            regular, last, more = await self._page(ino, after)
            files.update(regular)
            if not more or last is None:
                return files
            after = last

    async def _page(
        self, ino: int, after: bytes | None
    ) -> tuple[list[tuple[bytes, Listed]], bytes | None, bool]:
        """A page's regular files, its last name and whether more follow.
        Read as rows (decoded and kept at 0.4 µs a name, against 1.6 for the
        attributes and layouts of `readdir_layouts`); a server of before rows
        gives attribute maps."""
        rows = await self.fs.readdir_rows(ino, after, READDIR_MAX)
        if rows is not None:
            entries = rows["entries"]
            regular = [
                (row[0], (row[INO_AT], row[SIZE_AT], row[MTIME_AT], row[CTIME_AT]))
                for row in entries
                if stat.S_ISREG(row[MODE_AT])
            ]
            return regular, entries[-1][0] if entries else None, rows["more"]
        page = await self.fs.readdir(ino, after, READDIR_MAX)
        maps = page["entries"]
        regular = [
            (name, (a["ino"], a["size"], a["mtime"], a["ctime"]))
            for name, a in maps
            if stat.S_ISREG(a["mode"])
        ]
        return regular, maps[-1][0] if maps else None, page["more"]

    def _room(self, now: float) -> bool:
        """Whether another directory may be listed: under MAX_LISTED names
        once listings unused for LISTING_TTL are dropped (least recently
        used first). Listings in use are not dropped for another: over a
        dataset larger than the bound, hinted in a random order, that
        listed every directory again and again (a directory's thousand
        names for each file hinted in it); its names are looked up instead."""
        while self.listed >= MAX_LISTED and self.listings:
            head, oldest = next(iter(self.listings.items()))
            if now - oldest.used_at < LISTING_TTL:
                break
            del self.listings[head]
            self.listed -= len(oldest.files)
        # (listings under way counted at the mean size: the first hints of
        # a job name dozens of directories at once)
        coming = self._listing_now * (self.listed // max(1, len(self.listings)))
        return self.listed + coming < MAX_LISTED

    def counts(self) -> dict[str, int]:
        """The prefetch state's counts of listings (fuse/prefetch.py, `status`)."""
        return {
            "listings": self.listings_made,
            "listings_kept": self.revalidated,
            "unlisted": self.unlisted,
        }

    def _keep(self, head: bytes, listing: Listing) -> None:
        """*listing* as the most recently used (the bound is `_room`'s)."""
        old = self.listings.pop(head, None)  # (gone already if dropped meanwhile)
        self.listings[head] = listing
        self.listed += len(listing.files) - (len(old.files) if old is not None else 0)


async def all_or_first_error(calls: list[Callable[[], Awaitable[None]]]) -> None:
    """Run *calls* at once; the first FsError fails the hint (its batch)."""
    if len(calls) <= 1:
        for call in calls:
            await call()  # (no nursery for the common case)
        return
    try:
        async with trio.open_nursery() as nursery:
            for call in calls:
                nursery.start_soon(call)
    except* FsError as group:
        raise first_fs_error(group) from None


def merged_ranges(hints: list[Hint], size: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of *hints* in one file of *size* bytes, out to
    whole pages (what the kernel asks for) and merged where they touch."""
    spans = []
    for h in hints:
        end = size if h.length is None else min(size, h.offset + h.length)
        start = h.offset - h.offset % PAGE
        end = min(size, -(-end // PAGE) * PAGE)
        if start < end or (start == 0 and size == 0):
            spans.append((start, end))
    spans.sort()
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


async def open_ahead(fs: FileSystem, inos: list[int]) -> dict[int, tuple[Version, Layout | None]]:
    """The version and layout of files about to be read: read-only handles
    taken in one call and left in the client's open cache, where the
    reader's own open (and on cache=immutable the first READ that the
    fetched bytes do not answer) finds them (`OpenCache.open_ahead`).
    Without that cache: an open and a release each."""
    cache = fs.open_cache
    if cache.enabled:
        held = await cache.open_ahead(inos)
        return {ino: (version_of(e.attr), e.layout) for ino, e in held.items()}
    out = {}
    for ino in inos:
        try:
            f, attr = await fs.open(ino, os.O_RDONLY)
        except FsError as exc:
            if exc.code != errno.ENOENT:
                raise
            continue  # gone
        try:
            out[ino] = (version_of(attr), f.layout)
        finally:
            with trio.CancelScope(shield=True):
                await fs.release(f.fh)
    return out
