"""Concurrent requests to one storage node, coalesced into one frame.

A mount sees many reads in flight at once (one per reader thread or process
of a training job), and an import many small files' writes. Sent one frame
each, every request pays a whole request at the daemon (a scheduler trip, a
frame decode, a reply encode, two socket calls; for a write also its locks,
its forward down the chain and its update steps) and on the client (a send,
a receive, a wake-up): far more than the bytes themselves. So requests to a
node ride together: while `frames_in_flight` frames are in flight to a node,
further requests for it wait in that node's queue; when a frame's reply is
in, the first waiter takes everything queued (within the request limits)
and sends it as ONE request. The reply is cut back into each waiter's share.

Self-clocking, like Nagle without the timer: a lone request goes out at once
(nothing is ever held back waiting for company), and the busier the node,
the bigger the frames. Per waiter the result is exactly what its own request
would have answered.

Failures: a frame that fails as a whole (reset, timeout) fails every request
in it and every request queued behind it (they would only wait out the same
dead node; their callers retry). A request-level refusal of a coalesced
frame (EINVAL, EMSGSIZE) is not one request's fault: each is then sent again
alone, so only its own answer reaches it.

`ReadBatcher` (client/read_batcher.py) and `WriteBatcher`
(client/write_batcher.py) say how a frame is sent and its reply shared out.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

ItemT = TypeVar("ItemT")  # an item of a request

REFUSED_AS_A_WHOLE = (errno.EINVAL, errno.EMSGSIZE)


@dataclass(eq=False)
class Queued(Generic[ItemT]):
    items: list[ItemT]
    timeout: float
    nbytes: int
    wake: trio.Event | None = None  # made when it queues (a lone request never waits)
    lead: bool = False  # woken to send the queue (not with a result)
    result: Any = None
    error: FsError | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def wake_up(self) -> None:
        if self.wake is not None:
            self.wake.set()


@dataclass(eq=False)
class NodeQueue(Generic[ItemT]):
    frames_in_flight: int = 1
    frames: int = 0  # frames in flight
    queue: deque[Queued[ItemT]] = field(default_factory=deque)

    def promote(self) -> None:
        """A frame finished: the first waiter still queued sends the queue."""
        if self.queue and self.frames < self.frames_in_flight:
            first = self.queue[0]
            if not first.lead:
                first.lead = True
                first.wake_up()

    def take(
        self, max_items: int, max_bytes: int, batcher: FrameBatcher[ItemT]
    ) -> list[Queued[ItemT]]:
        """The queued requests that fit one frame, oldest first (stopping at
        one whose item *batcher* says may not share this frame)."""
        batch: list[Queued[ItemT]] = []
        keys: set[Hashable] = set()
        items = nbytes = 0
        while self.queue:
            w = self.queue[0]
            if batch and (items + len(w.items) > max_items or nbytes + w.nbytes > max_bytes):
                break
            if batcher.keyed:
                mine = {batcher.unique_key(it) for it in w.items}
                if not keys.isdisjoint(mine):
                    break
                keys |= mine
            self.queue.popleft()
            batch.append(w)
            items += len(w.items)
            nbytes += w.nbytes
        return batch

    def leave(self, w: Queued[ItemT]) -> None:
        """A waiter gives up (cancelled, timed out): out of the queue, and
        the lead it was given (if any) passed on."""
        if w in self.queue:
            self.queue.remove(w)
        if w.lead:
            w.lead = False
            self.promote()

    def fail_queue(self, error: FsError) -> None:
        while self.queue:
            w = self.queue.popleft()
            w.error = error
            w.wake_up()


class FrameBatcher(ABC, Generic[ItemT]):
    """Per storage node: at most `frames_in_flight` frames, the rest queued
    and coalesced. A subclass sends a frame (`call`, and `alone` for a
    request with nothing queued) and shares its reply out (`split`)."""

    frames_in_flight = 1
    max_items = 1
    max_bytes = 1 << 20
    what = "request"  # in messages
    # a coalesced frame refused for these is sent again request by request
    refused_as_a_whole: tuple[int, ...] = REFUSED_AS_A_WHOLE
    keyed = False  # items may not share a frame with others of the same `unique_key`

    def __init__(self, rpc: RpcClient, timeout: float) -> None:
        self.rpc = rpc
        self.timeout = timeout
        self._nodes: dict[str, NodeQueue[ItemT]] = {}
        self.frames_sent = 0  # for tests and benchmarks: frames and requests they carried
        self.requests_sent = 0

    # ---- what a subclass says ----------------------------------------------

    @abstractmethod
    async def call(self, address: str, items: list[ItemT], timeout: float) -> Any:
        """One request of *items* to *address*: its reply."""

    async def alone(self, address: str, items: list[ItemT], timeout: float) -> Any:
        """A request with nothing queued for its node, sent at once: what the
        caller gets (by default the reply of `call`, checked)."""
        reply = await self.call(address, items, timeout)
        self.check(address, items, reply)
        return reply

    def check(self, address: str, items: list[ItemT], reply: Any) -> None:
        """Raise EPROTO if *reply* does not answer *items*."""

    @abstractmethod
    def split(self, batch: list[Queued[ItemT]], reply: Any) -> None:
        """Set each waiter's `result`: its share of *reply*."""

    @abstractmethod
    def weight(self, items: list[ItemT]) -> int:
        """The bytes *items* put in a frame (asked only of a request that
        queues: a lone one goes at once, uncounted)."""

    def node_failed(self, exc: FsError) -> bool:
        """Whether *exc*, failing a frame, says the node failed (the requests
        queued for it then fail too, rather than wait it out again)."""
        return exc.code not in self.refused_as_a_whole

    def unique_key(self, item: ItemT) -> Hashable:
        """Items with the same key never share a frame (asked if `keyed`)."""
        return None

    # ---- the queue ---------------------------------------------------------

    async def request(self, address: str, items: list[ItemT], timeout: float) -> Any:
        """What one request of *items* to *address* answers."""
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = NodeQueue(self.frames_in_flight)
        if node.frames < node.frames_in_flight and not node.queue:
            return await self._alone(address, node, items, timeout)
        me: Queued[ItemT] = Queued(items, timeout, self.weight(items))
        me.wake = trio.Event()
        node.queue.append(me)
        try:
            with trio.move_on_after(timeout * 2):  # the frame ahead, then ours
                await me.wake.wait()
        except BaseException:
            node.leave(me)
            raise
        if not me.wake.is_set():
            node.leave(me)
            raise FsError(errno.ETIMEDOUT, f"{self.what} to {address} timed out in its queue")
        if me.lead and not me.done:
            await self._send(address, node, node.take(self.max_items, self.max_bytes, self))
        if me.error is not None:
            raise FsError(me.error.code, me.error.message)
        return me.result

    async def _alone(
        self, address: str, node: NodeQueue[ItemT], items: list[ItemT], timeout: float
    ) -> Any:
        """A request with nothing queued for its node: its own frame, at
        once, answered to it directly (what `_frame` does for a batch of one)."""
        node.frames += 1
        self.frames_sent += 1
        self.requests_sent += 1
        try:
            return await self.alone(address, items, timeout)
        except FsError as exc:
            if self.node_failed(exc):
                node.fail_queue(exc)  # the node failed: do not wait it out again
            raise
        finally:
            node.frames -= 1
            node.promote()

    async def _send(self, address: str, node: NodeQueue[ItemT], batch: list[Queued[ItemT]]) -> None:
        """Send *batch* as one frame and hand out its reply. A shared frame is
        shielded (bounded by the timeout): the other waiters depend on it even
        if our caller gives up. A lone request needs no shield (and a cancel
        scope costs as much as a good part of a read)."""
        node.frames += 1
        try:
            if len(batch) == 1:
                await self._frame(address, node, batch)
            else:
                with trio.CancelScope(shield=True):
                    await self._frame(address, node, batch)
        finally:
            node.frames -= 1
            node.promote()

    async def _frame(
        self, address: str, node: NodeQueue[ItemT], batch: list[Queued[ItemT]]
    ) -> None:
        items = batch[0].items if len(batch) == 1 else [it for w in batch for it in w.items]
        timeout = batch[0].timeout if len(batch) == 1 else min(w.timeout for w in batch)
        self.frames_sent += 1
        self.requests_sent += len(batch)
        try:
            if len(batch) == 1:
                batch[0].result = await self.alone(address, items, timeout)
                batch[0].wake_up()
                return
            reply = await self.call(address, items, timeout)
            self.check(address, items, reply)
        except FsError as exc:
            if len(batch) > 1 and exc.code in self.refused_as_a_whole:
                for w in batch:  # not one request's fault: each alone gets its own answer
                    await self._frame(address, node, [w])
                return
            for w in batch:
                w.error = exc
                w.wake_up()
            if self.node_failed(exc):
                node.fail_queue(exc)  # the node failed: do not wait it out again
            return
        self.split(batch, reply)
        for w in batch:
            w.wake_up()
