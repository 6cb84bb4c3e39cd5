"""Write-behind: a write returns once its bytes are handed to background
tasks, so a stream of writes keeps several chunk writes in flight instead of
paying each one's round trip (and durable commit) in turn.

Rules: writes to the same chunk reach the chain in the order they were made
(each waits for the one before it on that chunk); at most `limit` bytes per
file are in flight; the first failure is kept and raised by the next write,
`drain` (flush, fsync, close, truncate, and any read of the file), as a local
filesystem reports a failed writeback at fsync/close.

Writes that continue a chunk piece still waiting for its turn join it
(`Queued`): a file written in many small pieces (FUSE sends each write(2) on
its own, at most 128 KiB) costs one chain write, with its flushes on every
replica, per chunk write in flight rather than per write call. Nothing waits
for more to come: the first write of a chunk leaves at once, and what
arrives meanwhile goes together next.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import KeysView
from dataclasses import dataclass, field

import trio

from shufflefs.client.layout import Piece, plan
from shufflefs.client.storage_client import StorageClient
from shufflefs.metadata.protocol import Attr, Layout, OwedAttrs
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer

log = logging.getLogger("shufflefs.client.write_behind")


@dataclass(eq=False)
class Queued:
    """A chunk piece not sent yet: its bytes grow while it waits (a
    caller's buffer it handed over is copied only when more joins it)."""

    chain: int
    offset: int  # in the chunk
    data: bytearray | memoryview


@dataclass
class InodeState:
    """What this client knows better than the metadata server about a file it has open."""

    size: int
    opens: int = 0
    writers: int = 0  # of the opens, those that write (their close is `close_files`)
    dirty: bool = False  # written since the length was last reported
    mtime: int = 0  # ns of the last local write
    # an explicit mtime (utime: cp -p, tar x) came after the last local
    # write: the length reports still to come leave the server's mtime
    mtime_set: bool = False
    # held by a length report or a setattr on its way: their replies come
    # back in the order the server applied them (an older size never
    # overwrites a newer one)
    meta_lock: trio.Lock = field(default_factory=trio.Lock)
    # the newest attributes the metadata server sent of this file (by their
    # `change` counter): a reply that comes in after a newer one was
    # answered before it (trio runs the tasks of replies that arrive
    # together in any order) and must not hand anyone an older size
    attr: Attr | None = None
    attr_at: float = 0.0  # time.monotonic() when `attr` came
    # `attr`'s change counter when this client changed the file in a way no
    # reply told of (`outdated`): attributes at or below it are from before
    outdated_at: int = -1
    generation: int = 0  # bumps with every local write
    # Writes acknowledged to the caller but still on their way to storage.
    pending_bytes: int = 0
    progress: trio.Event = field(default_factory=trio.Event)  # set when a write completes
    chunk_tails: dict[bytes, trio.Event] = field(default_factory=dict)  # last write per chunk
    # the last piece of a chunk while it waits for the one before it: a
    # write that continues it joins it
    queued: dict[bytes, Queued] = field(default_factory=dict)
    error: FsError | None = None  # the first failure of a write: reported by the next call
    # a writeback mount's setattrs of the open file not sent yet: they go
    # with its close, or with the next setattr or fsync (client/fs.py
    # `setattr_behind`); meanwhile laid over every reply (`FileSystem.overlay`)
    owed: OwedAttrs = field(default_factory=lambda: OwedAttrs())
    owed_ctime: int = 0  # ns: when the last of them was set

    def newest(self, attr: Attr) -> Attr:
        """*attr* if it is at least as new as any attributes seen before
        (and from now on the newest), else the newest seen."""
        if self.attr is not None and attr["change"] < self.attr["change"]:
            return self.attr
        self.attr = attr
        if attr["change"] > self.outdated_at:  # (a reply read before our change is not fresh)
            self.attr_at = time.monotonic()
        return attr

    def outdated(self) -> None:
        """This client changed the file (an unlink's nlink, a rename's or an
        xattr's ctime) and no reply said how: what it holds is not current
        until a reply read after that change comes."""
        self.attr_at = 0.0
        if self.attr is not None:
            self.outdated_at = self.attr["change"]

    @property
    def behind(self) -> bool:
        """Writes in flight or a failure not yet reported: a read must `drain` first."""
        return self.pending_bytes > 0 or self.error is not None


class LastAttrs:
    """The newest attributes of files whose `InodeState` this client has
    dropped (their last handle closed), for REPLY_SECONDS: a lookup or
    listing answered before a file's last length report but handled after
    its close (a writeback mount's closes finish in the background while the
    writer lists the directory) must not hand the kernel the size from
    before the report, by the same `change` counter rule as
    `InodeState.newest`. A reply newer than the one kept is taken as is."""

    REPLY_SECONDS = 30.0  # > a metadata call's timeout: no reply is older
    LIMIT = 32768  # files remembered at most (the oldest dropped first)

    def __init__(self) -> None:
        self._kept: OrderedDict[int, tuple[float, Attr]] = OrderedDict()

    def keep(self, attr: Attr) -> None:
        now = time.monotonic()
        kept = self._kept
        kept.pop(attr["ino"], None)
        kept[attr["ino"]] = (now, attr)
        while kept:
            ino, (since, _) = next(iter(kept.items()))
            if len(kept) <= self.LIMIT and now - since < self.REPLY_SECONDS:
                break
            del kept[ino]

    def newest(self, attr: Attr) -> Attr:
        """*attr*, unless the one kept of its file is newer (by `change`)."""
        ino = attr["ino"]
        kept = self._kept.get(ino)
        if kept is None:
            return attr
        since, newest = kept
        if time.monotonic() - since >= self.REPLY_SECONDS:
            del self._kept[ino]
            return attr
        if attr["change"] < newest["change"]:
            return newest
        self._kept[ino] = (since, attr)
        return attr

    def __len__(self) -> int:
        return len(self._kept)

    def inodes(self) -> KeysView[int]:
        """The files kept (a view: `in` costs no call into Python)."""
        return self._kept.keys()


def raise_write_error(st: InodeState) -> None:
    """Report (once) the first failure of a write behind."""
    if st.error is not None:
        exc, st.error = st.error, None
        raise FsError(exc.code, f"an earlier write failed: {exc.message}")


async def drain(st: InodeState) -> None:
    """Wait for a file's writes in flight; raise the first failure."""
    while st.pending_bytes:
        await st.progress.wait()
    raise_write_error(st)


class WriteBehind:
    def __init__(self, storage: StorageClient, limit: int) -> None:
        self.storage = storage
        self.limit = limit  # bytes in flight per file (0: every write waits)

    async def write(
        self,
        ino: int,
        layout: Layout,
        st: InodeState,
        offset: int,
        data: Buffer,
        owned: bool = False,
    ) -> None:
        """Write *data* at *offset*: behind when there is room, else wait for
        room. *owned*: the caller hands *data* over and never changes it (as
        if it were `bytes`), so it is sent as it is, not copied."""
        raise_write_error(st)
        nursery = self.storage.background
        if nursery is None or self.limit <= 0:
            await self.storage.writes.write(ino, layout, offset, data)
            return
        n = len(memoryview(data))
        while st.pending_bytes and st.pending_bytes + n > self.limit:
            await st.progress.wait()
            raise_write_error(st)
        self.queue(ino, layout, st, offset, data, owned)

    def room(self, st: InodeState, n: int) -> bool:
        """Would `write` of *n* bytes go behind at once (no wait for room,
        no earlier failure to report)?"""
        return (
            self.storage.background is not None
            and self.limit > 0
            and st.error is None
            and not (st.pending_bytes and st.pending_bytes + n > self.limit)
        )

    def queue(
        self,
        ino: int,
        layout: Layout,
        st: InodeState,
        offset: int,
        data: Buffer,
        owned: bool = False,
    ) -> None:
        """Hand *data* to writes in the background (there is room: `room`).
        It is copied (the caller may reuse its buffer) unless it is `bytes`
        or *owned*."""
        nursery = self.storage.background
        assert nursery is not None
        n = len(memoryview(data))
        view = memoryview(data).cast("B")
        keep = owned or isinstance(data, bytes)  # nobody changes these bytes after us
        for p in plan([(ino, layout, offset, n)]):
            piece = view[p[4] : p[4] + p[3]]
            st.pending_bytes += p[3]
            waiting = st.queued.get(p[1])
            if waiting is not None and waiting.offset + len(waiting.data) == p[2]:
                if not isinstance(waiting.data, bytearray):
                    waiting.data = bytearray(waiting.data)  # (a view of a buffer handed over)
                waiting.data += piece  # continues the piece waiting its turn
                continue
            before = st.chunk_tails.get(p[1])
            done = st.chunk_tails[p[1]] = trio.Event()
            queued = Queued(p[0], p[2], piece if keep else bytearray(piece))
            if before is not None:
                st.queued[p[1]] = queued
            nursery.start_soon(self._write_piece, ino, layout, st, p[1], queued, before, done)

    async def _write_piece(
        self,
        ino: int,
        layout: Layout,
        st: InodeState,
        chunk: bytes,
        queued: Queued,
        before: trio.Event | None,
        done: trio.Event,
    ) -> None:
        """One chunk piece, after the write before it on the same chunk
        (what joined it meanwhile included)."""
        try:
            if before is not None:
                await before.wait()
            if st.queued.get(chunk) is queued:
                del st.queued[chunk]  # from here on its bytes are fixed
            length = len(queued.data)
            p: Piece = (queued.chain, chunk, queued.offset, length, 0)
            if st.error is None:
                await self.storage.writes.write_piece(ino, layout, p, memoryview(queued.data))
        except FsError as exc:
            log.warning("write-behind ino=%d chunk=%s failed: %s", ino, chunk.hex(), exc.message)
            if st.error is None:
                st.error = exc
        finally:
            if st.queued.get(chunk) is queued:  # cancelled while waiting
                del st.queued[chunk]
            st.pending_bytes -= len(queued.data)
            if st.chunk_tails.get(chunk) is done:
                del st.chunk_tails[chunk]
            done.set()
            st.progress.set()
            st.progress = trio.Event()
