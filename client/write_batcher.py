"""Concurrent chunk writes to one chain head, coalesced into one
`write_many` frame (the queue and its rules: client/frame_batcher.py).

An import or a `cp -r` of small files has many files' writes in flight at
once, each one chunk piece to the head of its chain. While a frame is in
flight to a head node, further writes for it wait, and the first of them
sends everything queued as one `write_many` (storage/batch_writes.py: one
request per replica for the whole batch). A write with nothing queued
goes at once as a plain `write`. Each write gets exactly its own answer:
its `WriteResult`, or its own error raised (the caller retries it as it
would a lone write).
"""

from __future__ import annotations

import errno
from collections.abc import Hashable
from typing import Any

from shufflefs.client.frame_batcher import FrameBatcher, Queued
from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.protocol import MAX_WRITE_ITEMS, StorageStub, WriteResult

# Frames in flight per head node: one, as for reads. With two, the batches
# were smaller and the daemons' CPU per file higher (3 replicas, 6,000 files
# of 110 KB, 256 in flight: 837 and 779 files/s against 781 and 729).
FRAMES_IN_FLIGHT = 1
MAX_REQUEST_BYTES = 16 << 20  # a quarter of the frame's payload limit
MAX_REQUEST_ITEMS = MAX_WRITE_ITEMS

# (target, chain, chain_version, chunk, offset, chunk_size, bytes)
ChunkWrite = tuple[int, int, int, bytes, int, int, Buffer]


class WriteBatcher(FrameBatcher[ChunkWrite]):
    frames_in_flight = FRAMES_IN_FLIGHT
    max_items = MAX_REQUEST_ITEMS
    max_bytes = MAX_REQUEST_BYTES
    what = "write"
    keyed = True  # a chunk once per target and frame (`unique_key`)
    # (ENOSYS: a daemon without `write_many` gets each write alone)
    refused_as_a_whole = (errno.EINVAL, errno.EMSGSIZE, errno.ENOSYS)

    def node_failed(self, exc: FsError) -> bool:
        # a write's own refusal (ENOSPC, ESTALE, EROFS...) says nothing of the others
        return exc.code in CONNECTION_FAILURES

    async def write(self, address: str, item: ChunkWrite, timeout: float) -> WriteResult:
        """What `write` of *item* to the head at *address* answers."""
        result: WriteResult = await self.request(address, [item], timeout)
        return result

    def weight(self, items: list[ChunkWrite]) -> int:
        return sum(len(item[6]) for item in items)

    async def alone(self, address: str, items: list[ChunkWrite], timeout: float) -> Any:
        [(target, chain, version, chunk, offset, chunk_size, data)] = items
        stub = StorageStub(self.rpc, address, timeout)
        return await stub.write(target, chain, version, chunk, offset, chunk_size, data)

    async def call(self, address: str, items: list[ChunkWrite], timeout: float) -> Any:
        wire = [(t, c, v, cid, off, cs, len(data)) for t, c, v, cid, off, cs, data in items]
        stub = StorageStub(self.rpc, address, timeout)
        return await stub.write_many(wire, [item[6] for item in items])

    def check(self, address: str, items: list[ChunkWrite], reply: Any) -> None:
        if len(reply) != len(items):
            raise FsError(errno.EPROTO, f"{address} answered {len(reply)} of {len(items)} writes")

    def split(self, batch: list[Queued[ChunkWrite]], reply: Any) -> None:
        for w, result in zip(batch, reply, strict=True):
            if isinstance(result, FsError):
                w.error = result
            else:
                w.result = result

    def unique_key(self, item: ChunkWrite) -> Hashable:
        return (item[0], item[3])
