"""The metadata calls of concurrent opens, batched.

Every open on a read-write mount asks the metadata server (close-to-open,
client/open_cache.py): a `getattr` for a file whose cached handle is kept,
an `open` once the handle lingered out (every open of an epoch longer than
`handle_linger`); that round trip is most of what a warm open costs. Opens
of several readers (a DataLoader's workers) overlap, so the ones that arrive
while a call is in flight wait for it to end and then go together in one
call (`getattrs`, `open_read_only`): one round trip for all, on both sides.

Close-to-open holds as with a call each: every caller's answer comes from a
call sent after the caller asked (a batch is closed to newcomers when it is
sent; whoever comes later joins the next one), so from what the primary
read after the open began.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from shufflefs.metadata.protocol import READDIR_MAX
from shufflefs.rpc.errors import FsError

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class _Batch(Generic[K, V]):
    keys: list[K] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    results: list[V | None] = field(default_factory=list)  # one per key, in order
    answered: bool = False  # `results` hold the answer
    now: trio.Event = field(default_factory=trio.Event)  # send it without gathering longer


class Batcher(Generic[K, V]):
    """`get(key)`: *one(key)* when nothing is in flight, else the answer
    for *key* from the next *many(keys)* call (None there: ENOENT)."""

    def __init__(
        self,
        one: Callable[[K], Awaitable[V]],
        many: Callable[[list[K]], Awaitable[list[V | None]]],
        what: str,
    ) -> None:
        self._one = one
        self._many = many
        self.what = what
        self._open: _Batch[K, V] | None = None  # gathering: sent once the call in flight ends
        self._in_flight: _Batch[K, V] | None = None
        self.batched = True  # until a metadata server answers ENOSYS
        self.calls = 0  # batched calls sent
        self.asked = 0  # keys asked through them

    async def get(self, key: K, linger: float = 0.0) -> V:
        """*key*'s answer. With *linger* (a caller that nobody waits for: a
        close carried out behind) a call is not sent at once when nothing is
        in flight: the keys asked during *linger* seconds go with it, unless
        a caller without linger joins, which sends it at once."""
        if not self.batched:
            return await self._one(key)
        if self._in_flight is None and self._open is None and linger <= 0:
            return await self._alone(key)
        batch = self._open
        if batch is None or len(batch.keys) >= READDIR_MAX:
            batch = self._open = _Batch()
            await self._lead(batch, key, linger)
            place = 0
        else:
            place = len(batch.keys)
            batch.keys.append(key)
            if linger <= 0:
                batch.now.set()
            await batch.done.wait()
        if not batch.answered:  # its leader was cancelled, or the call failed
            return await self._one(key)
        result = batch.results[place]
        if result is None:
            raise FsError(errno.ENOENT, f"{self.what}: no inode {key}")
        return result

    async def _alone(self, key: K) -> V:
        """Nothing in flight: the single call (no batch to wait for), which
        later callers wait behind as they would behind a batch."""
        batch: _Batch[K, V] = _Batch([key], answered=True)
        self._in_flight = batch
        try:
            return await self._one(key)
        finally:
            self._in_flight = None
            batch.done.set()

    async def _lead(self, batch: _Batch[K, V], key: K, linger: float) -> None:
        """Gather *batch* (*key* first) for *linger* seconds at most and
        while the call in flight runs, then send it. (Keys are not merged:
        two opens of one file each get a handle of their own.)"""
        batch.keys.append(key)
        try:
            if linger > 0:
                with trio.move_on_after(linger):
                    await batch.now.wait()
            while self._in_flight is not None:
                await self._in_flight.done.wait()
            if self._open is batch:
                self._open = None  # closed: whoever asks from now on waits for the next
            self._in_flight = batch
            try:
                self.calls += 1
                self.asked += len(batch.keys)
                results = await self._many(batch.keys)
                if len(results) != len(batch.keys):
                    raise FsError(errno.EIO, f"{self.what}: {len(results)} answers")
                batch.results = results
                batch.answered = True
            except FsError as exc:
                # each asks on its own (not answered), for its own answer
                # (one inode's failure fails the whole call)
                if exc.code == errno.ENOSYS:  # a server of before the batched call
                    self.batched = False
            finally:
                self._in_flight = None
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
