"""Fresh attributes for concurrent opens in one call.

Every open on a read-write mount revalidates its file with the metadata
server (close-to-open, client/open_cache.py): a `getattr` per open, the
most of what a warm open costs. Opens of several readers (a DataLoader's
workers) overlap, so the ones that arrive while a call is in flight wait
for it to end and then go together in one `getattrs` call: one round trip
for all of them, on both sides.

Close-to-open holds as with a call each: every caller's attributes come
from a call sent after the caller asked (a batch is closed to newcomers when
it is sent; whoever comes later joins the next one), so from a snapshot the
primary read after the open began.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shufflefs.metadata.protocol import READDIR_MAX, Attr
from shufflefs.rpc.errors import FsError


@dataclass
class _Batch:
    inos: list[int] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    attrs: dict[int, Attr | None] = field(default_factory=dict)
    error: FsError | None = None
    sent: bool = False  # answered: `attrs` or `error` hold the result


class AttrBatcher:
    """`get(ino)`: the attributes of *ino* from a call sent after it was asked."""

    def __init__(
        self,
        one: Callable[[int], Awaitable[Attr]],
        many: Callable[[list[int]], Awaitable[list[Attr | None]]],
    ) -> None:
        self._one = one
        self._many = many
        self._open: _Batch | None = None  # gathering: sent once the one in flight ends
        self._in_flight: _Batch | None = None
        self.batched = True  # until a metadata server answers ENOSYS
        self.calls = 0  # getattrs calls sent
        self.asked = 0  # attributes asked through them

    async def get(self, ino: int) -> Attr:
        if not self.batched:
            return await self._one(ino)
        if self._in_flight is None and self._open is None:
            return await self._send_alone(ino)
        batch = self._open
        if batch is None or len(batch.inos) >= READDIR_MAX:
            batch = self._open = _Batch()
            await self._lead(batch, ino)
        else:
            batch.inos.append(ino)
            await batch.done.wait()
        if not batch.sent:  # not answered: its leader was cancelled, or ENOSYS
            return await self._one(ino)
        if batch.error is not None:
            raise batch.error
        attr = batch.attrs.get(ino)
        if attr is None:
            raise FsError(errno.ENOENT, f"no inode {ino}")
        return attr

    async def _send_alone(self, ino: int) -> Attr:
        """Nothing in flight: a plain getattr (no batch to wait for), which
        later callers wait behind as they would behind a batch."""
        batch = self._in_flight = _Batch([ino], sent=True)
        try:
            return await self._one(ino)
        finally:
            self._in_flight = None
            batch.done.set()

    async def _lead(self, batch: _Batch, ino: int) -> None:
        """Gather *batch* while the call in flight runs, then send it."""
        batch.inos.append(ino)
        try:
            while self._in_flight is not None:
                await self._in_flight.done.wait()
            if self._open is batch:
                self._open = None  # closed: whoever asks from now on waits for the next
            self._in_flight = batch
            try:
                inos = list(dict.fromkeys(batch.inos))
                self.calls += 1
                self.asked += len(inos)
                attrs = await self._many(inos)
                batch.attrs = dict(zip(inos, attrs, strict=True))
                batch.sent = True
            except FsError as exc:
                if exc.code == errno.ENOSYS:  # a server of before getattrs:
                    self.batched = False  # each asks on its own (sent stays False)
                else:
                    batch.error = exc
                    batch.sent = True
            finally:
                self._in_flight = None
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
