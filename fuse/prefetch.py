"""Prefetch along the shuffle for readers of the mount (docs/training-data.md,
"Prefetch through the mount").

A loader that knows its upcoming order hands it to the mount as an extended
attribute; the mount reads the hinted bytes ahead from the storage daemons
(through `FileSystem.read_into`, the one read path). The interface (the
xattr forms: batches by setxattr on the mount root, or by getxattr with the
paths in the name on a read-only mount; one file by getxattr on it; the
state as JSON on a directory), its values and its errnos are described once,
in docs/training-data.md; fuse/prefetch_xattr.py takes them, and a batch is
checked and resolved whole (fuse/prefetch_hints.py) before anything is
queued here.

Why an xattr and not a control file: a control file would need a fake inode
that lookup, getattr, readdir, open and release all special-case (the cache
engineer's code paths), and errors of buffered writes surface at close, not
at the call that caused them; setxattr is one atomic call per batch whose
errno is the answer. Where fetched bytes wait: a file the kernel knows
(looked up or listed) goes into its page cache at once (fuse/page_store.py),
and the reader's reads never reach the mount; any other waits in a bounded
cache of our own (the kernel takes stored pages only for inodes it knows).

Warm epochs: a hint for a file the kernel's page cache holds is skipped
(fuse/prefetch_resident.py), and a getxattr whose every file was so answers
`HELD` instead of `QUEUED` (a loader then sends fewer:
client/data/mount_hints.py).

Bounded: fetched plus in-flight bytes never exceed the budget (mount option
``prefetch_memory=``); queued hints beyond MAX_PENDING push out the oldest
(the loader has moved on). A range is dropped once a read took its last
byte, or when a handle that read from it is released (a sample is read once
per epoch), when the file changes
(a write or truncate through this mount, an open that sees another version
after another client's close: close-to-open), when its name is unlinked or
renamed over here, or ENTRY_TTL (10 s) after it was fetched when room is needed
(on an immutable mount, or in a warm epoch the kernel answers, many are
never read here).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from shufflefs.client.fs import FileSystem
from shufflefs.fuse.page_store import Fetched
from shufflefs.fuse.prefetch_hints import (
    HELD,
    LISTING_TTL,
    QUEUED,
    Hint,
    HintResolver,
    Version,
    merged_ranges,
    open_ahead,
    parse_hint,
    version_of,
)
from shufflefs.fuse.prefetch_landing import Chunks, Landing
from shufflefs.fuse.prefetch_resident import ResidentSkips
from shufflefs.metadata.protocol import Attr, Layout
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.fuse.prefetch")

DEFAULT_MEMORY = 256 << 20
MAX_PENDING = 65536  # queued ranges, beyond which the oldest are dropped
FETCHERS = 8  # ranges read concurrently
MAX_RANGES_PER_READ = 1024  # hinted ranges of one file read together
MAX_FILES_PER_READ = 256  # listed files read together (one request per storage node)
READ_BATCH = 8 << 20  # bytes of listed files read together
ENTRY_TTL = 10.0  # seconds an unread entry keeps its room when room is needed


@dataclass
class Entry:
    version: Version
    offset: int
    data: bytearray
    name: tuple[int, bytes] | None
    fetched_at: float
    served: bool = False

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


@dataclass
class Counters:
    hinted: int = 0  # ranges queued
    fetched: int = 0  # ranges read into the cache
    hits: int = 0  # reads answered from the cache
    dropped: int = 0  # queued ranges pushed out unread (MAX_PENDING)
    invalidated: int = 0  # entries dropped because their file changed
    expired: int = 0  # entries dropped unread after ENTRY_TTL
    failed: int = 0  # ranges whose read failed (the reader will read them itself)
    resident: int = 0  # hints skipped: the kernel's page cache holds those bytes
    stored: int = 0  # ranges handed to the kernel's page cache (fuse/page_store.py)
    late: int = 0  # whole files not fetched: read before their turn came
    waited: int = 0  # READs that waited for the prefetch read of their file under way
    evicted: int = 0  # reads that reached us for a skipped hint: the kernel had dropped it
    fetched_bytes: int = 0
    served_bytes: int = 0


def nothing_held(ino: int, version: Version, end: int) -> bool:
    return False


async def nothing_stored(
    files: list[Fetched], changed: Callable[[int], bool], skip: Callable[[int], bool]
) -> set[int]:
    return set()


@dataclass
class Prefetcher:
    fs: FileSystem
    budget: int = DEFAULT_MEMORY
    # does the kernel's page cache already hold (ino, version) up to a byte
    # offset? Such hints are skipped: a warm epoch would otherwise fetch every
    # sample again into a cache no read consults (the kernel answers them)
    kernel_holds: Callable[[int, Version, int], bool] = nothing_held
    # hands fetched files to the kernel's page cache; those it took
    store: Callable[
        [list[Fetched], Callable[[int], bool], Callable[[int], bool]], Awaitable[set[int]]
    ] = nothing_stored
    # ino -> the byte ranges held of it (all of one version)
    entries: OrderedDict[int, list[Entry]] = field(default_factory=OrderedDict)
    names: dict[tuple[int, bytes], int] = field(default_factory=dict)  # (parent, name) -> ino
    pending: deque[Hint] = field(default_factory=deque)
    counters: Counters = field(default_factory=Counters)
    held: int = 0  # bytes in entries plus bytes of reads in flight
    running: bool = False
    last_hinted: float = -math.inf  # time.monotonic() of the last hints' arrival

    def __post_init__(self) -> None:
        self._wake = trio.Event()  # pending grew (what idle fetchers wait for)
        self._room = trio.Event()  # room was freed (what fetchers short of room wait for)
        self._generation = 0  # counts changes and resets
        self._reset_at = 0
        self._changed: dict[int, int] = {}  # ino -> generation of its last change
        self._in_flight = 0
        self.resident = ResidentSkips(self.kernel_holds)  # warm epochs' hints skipped
        self.resolver = HintResolver(self.fs)
        self.landing = Landing()  # bytes read, not stored or kept yet

    async def start(self, nursery: trio.Nursery) -> None:
        if self.budget <= 0:
            return
        self.running = True
        for _ in range(FETCHERS):
            nursery.start_soon(self._fetch_loop)

    # ---- the hint interface (called from the xattr handlers) -------------

    async def hint_batch(self, value: bytes) -> None:
        """setxattr on the mount root: check and resolve all, then queue all."""
        self._check_enabled()
        if not value.strip():  # an empty hint: start over
            self.pending.clear()
            self._generation += 1
            self._reset_at = self._generation  # and reads in flight are dropped
            for ino in list(self.entries):
                self._drop(ino)
            return
        await self.hint_paths(parse_hint(value))

    async def hint_paths(self, items: list[tuple[bytes, int, int | None]]) -> bool:
        """(path, offset, length) items: checked and resolved all, then queued
        all; whether the kernel held every one (`_queue`)."""
        self._check_enabled()
        self.hint_arrived()
        for _, _, length in items:
            if length is not None and length > self.budget:
                raise FsError(
                    errno.E2BIG, f"prefetch hint: a range of {length} bytes > budget {self.budget}"
                )
        return self._queue(await self.resolver.resolve(items))

    async def hint_file(self, attr: Attr) -> bytes:
        """getxattr on an inode: a directory answers the state, a file is queued."""
        if stat.S_ISDIR(attr["mode"]):
            return self.status()
        if not stat.S_ISREG(attr["mode"]):
            self._check_enabled()
            raise FsError(errno.EINVAL, "prefetch: not a regular file")
        return self.hint_inode(attr["ino"], version_of(attr))

    def hint_inode(self, ino: int, version: Version) -> bytes:
        """Queue the whole file *ino* (of *version* as last seen)."""
        self._check_enabled()
        self.hint_arrived()
        return HELD if self._queue([Hint(ino, 0, None, version=version)]) else QUEUED

    def status(self) -> bytes:
        state = {
            "budget": self.budget,
            "held_bytes": self.held,
            "entries": sum(len(held) for held in self.entries.values()),
            "pending": len(self.pending),
            **vars(self.counters),
            **self.resolver.counts(),
        }
        return json.dumps(state, separators=(",", ":")).encode()

    def _check_enabled(self) -> None:
        if not self.running:
            raise FsError(errno.EOPNOTSUPP, "prefetch is off on this mount (prefetch_memory=0)")

    def hinted_within(self, seconds: float) -> bool:
        """Was anything hinted in the last *seconds*? (A loader hinting its
        order has its files fetched here, by layout, no open needed.)"""
        return time.monotonic() - self.last_hinted < seconds

    def hint_arrived(self) -> None:
        """Hints came (noted before they are resolved: the reads behind
        them may come first)."""
        self.last_hinted = time.monotonic()

    def _queue(self, hints: list[Hint]) -> bool:
        """Queue *hints*, skipping at once those the kernel holds (a warm
        epoch wakes no fetcher), and wake the fetchers once; whether every
        one was skipped so (what a hinting getxattr answers: `HELD`)."""
        now = time.monotonic()
        queued = False
        for hint in hints:
            self.counters.hinted += 1
            if self.resident.skip(hint):
                self.counters.resident += 1
                continue
            if len(self.pending) >= MAX_PENDING:
                self.pending.popleft()
                self.counters.dropped += 1
            hint.at = now
            self.pending.append(hint)
            queued = True
        if queued:
            self._notify()
        return bool(hints) and not queued

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    def _freed(self) -> None:
        # not `_notify`: a fetcher short of room waits for `_room`, and an
        # idle one has nothing to fetch (every sample served would wake all
        # FETCHERS for nothing: measured, most of the loop's scheduling)
        self._room.set()
        self._room = trio.Event()

    # ---- fetching ----------------------------------------------------------

    async def _fetch_loop(self) -> None:
        while True:
            if not self.pending:
                await self._wake.wait()
                continue
            if self.held >= self.budget and not self._expire():
                await self._room_or_expiry()
                continue
            groups = self._next_groups()
            if not groups:
                continue
            try:
                await self._fetch(groups)
            except FsError as exc:
                self.counters.failed += sum(len(h) for _, h in groups)
                log.debug("prefetch of inodes %s: %s", [i for i, _ in groups][:8], exc.message)
            except Exception:
                self.counters.failed += sum(len(h) for _, h in groups)
                log.exception("prefetch of inodes %s", [i for i, _ in groups][:8])

    @property
    def _batch_bytes(self) -> int:
        return min(READ_BATCH, max(1, self.budget // 4))

    def _next_groups(self) -> list[tuple[int, list[Hint]]]:
        """The next hints to read together, per file in order: up to
        `_batch_bytes` of up to MAX_FILES_PER_READ files in one read (one
        request per storage node). A file of unknown size counts once it is
        known: `_fetch` puts back what it finds beyond the batch."""
        groups: dict[int, list[Hint]] = {}
        limit = self._batch_bytes
        size = 0
        while self.pending and len(groups) < MAX_FILES_PER_READ:
            hint = self.pending[0]
            if groups and hint.ino not in groups and size >= limit:
                break
            if len(groups.get(hint.ino, ())) >= MAX_RANGES_PER_READ:
                break
            self.pending.popleft()
            if self.landing.late(hint):
                self.counters.late += 1  # the reader was there first: fetch what comes next
            elif self.resident.skip(hint):
                self.counters.resident += 1
            elif not self._covered(hint.ino, hint.offset, hint.length):
                groups.setdefault(hint.ino, []).append(hint)
                if hint.version is not None:
                    size += hint.version[0] if hint.length is None else hint.length
        return list(groups.items())

    def _covered(self, ino: int, offset: int, length: int | None) -> bool:
        for e in self.entries.get(ino, ()):
            size = e.version[0]
            end = size if length is None else min(size, offset + length)
            if e.offset <= offset and end <= e.end:
                return True
        return False

    def _batch(
        self, groups: list[tuple[int, list[Hint]]], known: dict[int, tuple[Version, Layout | None]]
    ) -> list[tuple[int, list[Hint], Version, Layout, list[tuple[int, int]]]]:
        """What of *groups* one read takes (up to `_batch_bytes`, at least one
        file); the rest goes back to the front of the queue, its versions
        known now (its handles wait in the open cache)."""
        limit = self._batch_bytes
        files: list[tuple[int, list[Hint], Version, Layout, list[tuple[int, int]]]] = []
        length = 0
        for k, (ino, hints) in enumerate(groups):
            if ino not in known:
                self.counters.failed += len(hints)  # gone before we opened it
                continue
            version, layout = known[ino]
            ranges = merged_ranges(hints, version[0])
            size = sum(e - o for o, e in ranges)
            if layout is None or size > self.budget:
                continue  # not a file, or larger than the whole budget
            if files and length + size > limit:
                back = [
                    replace(h, version=known[i][0])
                    for i, group in groups[k:]
                    if i in known
                    for h in group
                ]
                self.pending.extendleft(reversed(back))
                self._notify()  # an idle fetcher may take them meanwhile
                break
            files.append((ino, hints, version, layout, ranges))
            length += size
        return files

    async def _fetch(self, groups: list[tuple[int, list[Hint]]]) -> None:
        start = self._generation

        def changed(ino: int) -> bool:  # since this read began
            return self._changed.get(ino, -1) > start

        self._in_flight += 1
        reserved = 0
        fetched: list[tuple[int, list[Hint], Version, Chunks]] = []
        # READs of these files wait for their bytes from now on (not only
        # while they are read: the open and the batching come first)
        waiting = self.landing.begin([ino for ino, _ in groups])
        try:
            # every file opened (one call for those not held yet): a file
            # removed since its listing is left out, and none is freed while
            # it is read
            known = await open_ahead(self.fs, [ino for ino, _ in groups])
            files = self._batch(groups, known)
            waiting = self.landing.end(waiting, keep={ino for ino, *_ in files})
            extents = [
                (ino, layout, off, end - off)
                for ino, _, _, layout, ranges in files
                for off, end in ranges
            ]
            length = sum(e[3] for e in extents)
            while self.held + length > self.budget:
                if not self._expire():
                    waiting = self.landing.end(waiting)  # no READ waits for room
                    await self._room_or_expiry()
            reserved = length
            self.held += reserved
            data = bytearray(length)
            view = memoryview(data)
            if length:
                await self.fs.read_into(extents, view, cold=True)
            pos = 0
            for ino, hints, version, _, ranges in files:
                chunks = []
                for off, end in ranges:
                    chunks.append((off, view[pos : pos + end - off]))
                    pos += end - off
                fetched.append((ino, hints, version, chunks))
                if not changed(ino):
                    self.landing.arrived(version, ino, chunks)
            waiting = self.landing.end(waiting)  # READs waiting for them go on

            stored = await self.store(
                [(ino, version, chunks) for ino, _, version, chunks in fetched],
                changed,
                lambda ino: changed(ino) or ino in self.landing.served,  # (its reader has them)
            )
            for ino, hints, version, chunks in fetched:
                if ino in stored:  # in the kernel's page cache now
                    self.counters.stored += len(hints)
                    self.counters.fetched_bytes += sum(len(c) for _, c in chunks)
                    continue
                if ino not in self.landing.served:  # (else its reader had them as they came)
                    if changed(ino) or self._reset_at > start:
                        continue  # changed (or reset) while we read: the bytes may be stale
                    reserved -= self._keep(ino, hints, version, chunks)
                self.counters.fetched += len(hints)
                self.counters.fetched_bytes += sum(len(c) for _, c in chunks)
        finally:
            self.landing.end(waiting)
            self.landing.settled([ino for ino, *_ in fetched])
            self.held -= reserved
            self._in_flight -= 1
            if self._in_flight == 0:
                self._changed.clear()
            if reserved:
                self._freed()

    def _keep(self, ino: int, hints: list[Hint], version: Version, chunks: Chunks) -> int:
        """Hold *ino*'s fetched *chunks* here (a copy: the batch's buffer is
        not kept); the bytes now held."""
        if ino in self.entries and self.entries[ino][0].version != version:
            self._drop(ino)  # held bytes of an older version
        held = self.entries.setdefault(ino, [])
        now = trio.current_time()
        for off, chunk in chunks:
            held.append(Entry(version, off, bytearray(chunk), hints[0].name, now))
        self.entries.move_to_end(ino)
        if hints[0].name is not None:
            self.names[hints[0].name] = ino
        return sum(len(c) for _, c in chunks)

    def _expire(self) -> bool:
        """Drop files whose bytes were fetched ENTRY_TTL ago (the oldest
        come first: a fetch moves its file to the end); whether room was
        freed."""
        now = trio.current_time()
        old = []
        for ino, held in self.entries.items():
            if any(now - e.fetched_at <= ENTRY_TTL for e in held):
                break
            old.append(ino)
        for ino in old:
            self._drop(ino)
            self.counters.expired += 1
        return bool(old)

    async def _room_or_expiry(self) -> None:
        """Wait until bytes are dropped or the oldest file's ENTRY_TTL ends
        (not for new hints: a full cache has no room for them either)."""
        deadline = trio.current_time() + 1.0
        if self.entries:
            oldest = next(iter(self.entries.values()))
            deadline = max(e.fetched_at for e in oldest) + ENTRY_TTL
        with trio.move_on_at(deadline):
            await self._room.wait()

    def _drop_entry(self, ino: int, entry: Entry) -> None:
        held = self.entries[ino]
        held.remove(entry)
        self.held -= len(entry.data)
        if not held:
            del self.entries[ino]
            if entry.name is not None and self.names.get(entry.name) == ino:
                del self.names[entry.name]
        self._freed()

    def _drop(self, ino: int, only_served: bool = False) -> bool:
        """Drop what is held of *ino* (or only the ranges that served a read);
        whether anything was."""
        held = self.entries.get(ino)
        if not held:
            return False
        gone = [e for e in held if e.served] if only_served else held
        if not gone:
            return False
        kept = [e for e in held if not e.served] if only_served else []
        self.held -= sum(len(e.data) for e in gone)
        if kept:
            self.entries[ino] = kept
        else:
            del self.entries[ino]
            name = gone[0].name
            if name is not None and self.names.get(name) == ino:
                del self.names[name]
        self._freed()
        return True

    # ---- hooks of the FUSE operations ------------------------------------

    def opened(self, attr: Attr) -> None:
        """An open saw *attr*: data of another version is dropped."""
        self.landing.drop(attr["ino"], unless=version_of(attr))
        held = self.entries.get(attr["ino"])
        if held and held[0].version != version_of(attr):
            self._drop(attr["ino"])
            self.counters.invalidated += 1

    def entry_of(self, parent: int, name: bytes, max_age: float) -> Attr | None:
        """The attributes of *name* in *parent* if its bytes are held here,
        from the handle they were read under (still in the open cache), and
        name and attributes are no older than *max_age* (its listing's age
        counted at most): what a read-only mount answers a LOOKUP with, no
        round trip (the reader of a hinted file asks for it next)."""
        ino = self.names.get((parent, name), 0)
        held = self.entries.get(ino)
        if not held:
            return None
        cached = self.fs.open_cache.entries.get(ino)
        if cached is None or version_of(cached.attr) != held[0].version:
            return None
        if trio.current_time() - held[0].fetched_at + LISTING_TTL > max_age:
            return None
        return cached.attr

    def version_held(self, ino: int) -> Version | None:
        """The version of *ino* whose bytes are held, if any."""
        held = self.entries.get(ino)
        return held[0].version if held else self.landing.version(ino)

    async def read_or_wait(self, ino: int, offset: int, size: int) -> memoryview | None:
        """`read`, and if *ino* is being read ahead right now, `read` once
        its bytes came."""
        got = self.read(ino, offset, size)
        if got is None and await self.fetched(ino):
            got = self.read(ino, offset, size)
        return got

    async def fetched(self, ino: int) -> bool:
        """If *ino* is being read ahead right now: wait for its bytes (a
        while at most), rather than reading them a second time; whether
        they are here now (`read` answers from them)."""
        if ino not in self.landing.fetching:
            return False
        self.counters.waited += 1
        return await self.landing.wait(ino)

    def read(self, ino: int, offset: int, size: int) -> memoryview | None:
        """The bytes of a read if one held range has all of them (clamped to
        the file's end as it was fetched), else None."""
        if self.resident.skipped and ino in self.resident.skipped:
            self.counters.evicted += 1  # the kernel did not have it all
            again = self.resident.missed(ino)
            if again:  # evicting whole files: fetch the others after all, in order
                self.pending.extend(again)
                while len(self.pending) > MAX_PENDING:
                    self.pending.popleft()
                    self.counters.dropped += 1
                self._notify()
        for e in self.entries.get(ino, ()):
            end = min(offset + size, e.version[0])
            if e.offset <= offset <= end <= e.end:
                e.served = True
                self.counters.hits += 1
                self.counters.served_bytes += end - offset
                out = memoryview(e.data)[offset - e.offset : end - e.offset]
                if end >= min(e.end, e.version[0]):
                    self._drop_entry(ino, e)  # read to its end: the sample is taken
                return out
        landed = self.landing.read(ino, offset, size) if self.landing.landed else None
        if landed is not None:
            self.counters.hits += 1
            self.counters.served_bytes += len(landed)
            return landed
        self.passed(ino)
        return None

    def passed(self, ino: int) -> None:
        """A READ of *ino* that the cache did not answer (also called from
        the FUSE thread of fuse/fast_reads.py)."""
        if self.pending:  # (a hint queued before it is late)
            self.landing.passed(ino)

    def released(self, ino: int) -> None:
        """A handle was closed: the ranges it read from have served their
        samples (and a skipped file read from the page cache is taken)."""
        self.resident.taken(ino)
        self._drop(ino, only_served=True)

    def changed(self, ino: int) -> None:
        """This mount wrote or truncated *ino*: its cached bytes are stale."""
        self._generation += 1
        if self._in_flight:
            self._changed[ino] = self._generation
        self.landing.drop(ino)
        if self._drop(ino):
            self.counters.invalidated += 1

    def name_changed(self, parent: int, name: bytes) -> None:
        """*name* in *parent* was unlinked or renamed away or over."""
        ino = self.names.get((parent, name))
        if ino is not None:
            self.changed(ino)
