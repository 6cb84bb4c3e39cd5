"""Concurrent reads to one storage node, coalesced into one `read` frame
(the queue and its rules: client/frame_batcher.py).

A mount sees many reads in flight at once (one per reader thread or process
of a training job), each for a few KiB: while a frame is in flight to a
node, further reads for it wait, and the first of them sends everything
queued as ONE `read` request, whose reply is cut back into each read's
share. Per read the result is exactly what its own request would have
answered (per item a length or a negative errno, and its bytes).
"""

from __future__ import annotations

import errno
from typing import Any

from shufflefs.client.frame_batcher import FrameBatcher, Queued
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.storage.protocol import MAX_READ_ITEMS, ReadItem, read_items

FRAMES_IN_FLIGHT = 1  # per node: more frames than this wait and coalesce
# Well under the reply payload limit (64 MiB) and the daemon's item limit, so
# no request is refused.
MAX_REQUEST_BYTES = min(16 << 20, DEFAULT_LIMITS.max_payload // 2)
MAX_REQUEST_ITEMS = MAX_READ_ITEMS

ReadReply = tuple[list[int], memoryview]
QueuedRead = Queued[ReadItem]


def split_reply(batch: list[QueuedRead], lengths: list[int], payload: memoryview) -> None:
    """Give each waiter its lengths and its slice of the payload."""
    pos = i = 0
    for w in batch:
        mine = lengths[i : i + len(w.items)]
        i += len(w.items)
        n = sum(x for x in mine if x > 0)
        w.result = (mine, payload[pos : pos + n])
        pos += n


class ReadBatcher(FrameBatcher[ReadItem]):
    """Per storage node: at most `FRAMES_IN_FLIGHT` read frames, the rest
    queued and coalesced."""

    frames_in_flight = FRAMES_IN_FLIGHT
    max_items = MAX_REQUEST_ITEMS
    max_bytes = MAX_REQUEST_BYTES
    what = "read"

    @property
    def reads_sent(self) -> int:
        return self.requests_sent

    async def read(self, address: str, items: list[ReadItem], timeout: float) -> ReadReply:
        """What one `read` request of *items* to *address* answers: per item a
        length or a negative errno, and the delivered bytes in order."""
        reply: ReadReply = await self.request(address, items, timeout)
        return reply

    def weight(self, items: list[ReadItem]) -> int:
        return sum(max(0, it[3]) for it in items)

    async def call(self, address: str, items: list[ReadItem], timeout: float) -> Any:
        lengths, payload = await read_items(self.rpc, address, items, timeout)
        return lengths, memoryview(payload)

    def check(self, address: str, items: list[ReadItem], reply: Any) -> None:
        if len(reply[0]) != len(items):
            raise FsError(errno.EPROTO, f"{address} answered {len(reply[0])} of {len(items)}")

    def split(self, batch: list[QueuedRead], reply: Any) -> None:
        split_reply(batch, reply[0], reply[1])
