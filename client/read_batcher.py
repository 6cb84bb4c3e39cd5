"""Concurrent reads to one storage node, coalesced into one frame.

A mount sees many reads in flight at once (one per reader thread or process
of a training job), each for a few KiB. Sent one frame each, every read pays
a whole request at the daemon (a scheduler trip, a frame decode, a reply
encode, two socket calls) and on the client (a send, a receive, a wake-up):
far more than the read itself. So reads to a node ride together: while a
frame is in flight to a node, further reads for it wait in that node's queue;
when the frame's reply is in, the first waiter takes everything queued (within
the request limits) and sends it as ONE `read` request. The reply is cut back
into each waiter's share.

Self-clocking, like Nagle without the timer: a lone read goes out at once
(nothing is ever held back waiting for company), and the busier the node, the
bigger the frames. Per waiter the result is exactly what its own request
would have answered (per item a length or a negative errno, and its bytes).

Failures: a frame that fails as a whole (reset, timeout) fails every read in
it and every read queued behind it (they would only wait out the same dead
node; the read engine retries them elsewhere). A request-level refusal of a
coalesced frame (EINVAL, EMSGSIZE) is not one read's fault: each read is then
sent again alone, so only its own answer reaches it.
"""

from __future__ import annotations

import errno
from collections import deque
from dataclasses import dataclass, field

import trio

from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.storage.protocol import MAX_READ_ITEMS, ReadItem, read_items

FRAMES_IN_FLIGHT = 1  # per node: more frames than this wait and coalesce
# Well under the reply payload limit (64 MiB) and the daemon's item limit, so
# no request is refused.
MAX_REQUEST_BYTES = min(16 << 20, DEFAULT_LIMITS.max_payload // 2)
MAX_REQUEST_ITEMS = MAX_READ_ITEMS
REFUSED_AS_A_WHOLE = (errno.EINVAL, errno.EMSGSIZE)

ReadReply = tuple[list[int], memoryview]


@dataclass(eq=False)
class QueuedRead:
    items: list[ReadItem]
    timeout: float
    nbytes: int
    wake: trio.Event | None = None  # made when it queues (a lone read never waits)
    lead: bool = False  # woken to send the queue (not with a result)
    result: ReadReply | None = None
    error: FsError | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def wake_up(self) -> None:
        if self.wake is not None:
            self.wake.set()


@dataclass(eq=False)
class NodeQueue:
    frames: int = 0  # frames in flight
    queue: deque[QueuedRead] = field(default_factory=deque)

    def promote(self) -> None:
        """A frame finished: the first waiter still queued sends the queue."""
        if self.queue and self.frames < FRAMES_IN_FLIGHT:
            first = self.queue[0]
            if not first.lead:
                first.lead = True
                first.wake_up()

    def take(self) -> list[QueuedRead]:
        """The queued reads that fit one frame, oldest first."""
        batch: list[QueuedRead] = []
        items = nbytes = 0
        while self.queue:
            w = self.queue[0]
            if batch and (
                items + len(w.items) > MAX_REQUEST_ITEMS or nbytes + w.nbytes > MAX_REQUEST_BYTES
            ):
                break
            self.queue.popleft()
            batch.append(w)
            items += len(w.items)
            nbytes += w.nbytes
        return batch

    def leave(self, w: QueuedRead) -> None:
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


def split_reply(batch: list[QueuedRead], lengths: list[int], payload: memoryview) -> None:
    """Give each waiter its lengths and its slice of the payload."""
    pos = i = 0
    for w in batch:
        mine = lengths[i : i + len(w.items)]
        i += len(w.items)
        n = sum(x for x in mine if x > 0)
        w.result = (mine, payload[pos : pos + n])
        pos += n


class ReadBatcher:
    """Per storage node: at most `FRAMES_IN_FLIGHT` read frames, the rest queued
    and coalesced."""

    def __init__(self, rpc: RpcClient, timeout: float) -> None:
        self.rpc = rpc
        self.timeout = timeout
        self._nodes: dict[str, NodeQueue] = {}
        self.frames_sent = 0  # for tests and benchmarks: frames and reads they carried
        self.reads_sent = 0

    async def read(self, address: str, items: list[ReadItem], timeout: float) -> ReadReply:
        """What one `read` request of *items* to *address* answers: per item a
        length or a negative errno, and the delivered bytes in order."""
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = NodeQueue()
        if node.frames < FRAMES_IN_FLIGHT and not node.queue:
            return await self._alone(address, node, items, timeout)
        me = QueuedRead(items, timeout, 0)
        me.nbytes = sum(max(0, it[3]) for it in items)
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
            raise FsError(errno.ETIMEDOUT, f"read to {address} timed out in its queue")
        if me.lead and not me.done:
            await self._send(address, node, node.take())
        if me.error is not None:
            raise FsError(me.error.code, me.error.message)
        assert me.result is not None
        return me.result

    async def _alone(
        self, address: str, node: NodeQueue, items: list[ReadItem], timeout: float
    ) -> ReadReply:
        """A read with nothing queued for its node: its own frame, at once,
        answered to it directly (what `_frame` does for a batch of one)."""
        node.frames += 1
        self.frames_sent += 1
        self.reads_sent += 1
        try:
            lengths, payload = await read_items(self.rpc, address, items, timeout)
        except FsError as exc:
            if exc.code not in REFUSED_AS_A_WHOLE:
                node.fail_queue(exc)  # the node failed: do not wait it out again
            raise
        finally:
            node.frames -= 1
            node.promote()
        if len(lengths) != len(items):
            raise FsError(errno.EPROTO, f"{address} answered {len(lengths)} of {len(items)}")
        return lengths, memoryview(payload)

    async def _send(self, address: str, node: NodeQueue, batch: list[QueuedRead]) -> None:
        """Send *batch* as one frame and hand out its reply. A shared frame is
        shielded (bounded by the timeout): the other waiters depend on it even
        if our caller gives up. A lone read needs no shield (and a cancel scope
        costs as much as a good part of the read)."""
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

    async def _frame(self, address: str, node: NodeQueue, batch: list[QueuedRead]) -> None:
        items = batch[0].items if len(batch) == 1 else [it for w in batch for it in w.items]
        timeout = batch[0].timeout if len(batch) == 1 else min(w.timeout for w in batch)
        self.frames_sent += 1
        self.reads_sent += len(batch)
        try:
            lengths, payload = await read_items(self.rpc, address, items, timeout)
        except FsError as exc:
            if len(batch) > 1 and exc.code in REFUSED_AS_A_WHOLE:
                for w in batch:  # not one read's fault: each alone gets its own answer
                    await self._frame(address, node, [w])
                return
            for w in batch:
                w.error = exc
                w.wake_up()
            if exc.code not in REFUSED_AS_A_WHOLE:
                node.fail_queue(exc)  # the node failed: do not wait it out again
            return
        if len(lengths) != len(items):
            error = FsError(errno.EPROTO, f"{address} answered {len(lengths)} of {len(items)}")
            for w in batch:
                w.error = error
                w.wake_up()
            return
        split_reply(batch, lengths, memoryview(payload))
        for w in batch:
            w.wake_up()
