"""Writes to the storage daemons: every chunk piece to the head of its chain.

The head stages the bytes, forwards them down the chain and answers once
every serving replica holds them durably (CRAQ; see docs/storage.md).
Concurrent pieces for one head share a frame (`WriteBatcher`). A head
that went silent is taken out of its chain by mgmtd; the write then stops
waiting for it (`routing_changed`) and is retried on the new head.
"""

from __future__ import annotations

import errno
import functools
from dataclasses import dataclass, field

import trio

from shufflefs.client.layout import Piece, plan
from shufflefs.client.storage_parts import StoragePart
from shufflefs.client.write_batcher import WriteBatcher
from shufflefs.cluster.routing import ChainWatch, Routing
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import TRANSIENT, retrying
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.protocol import chain_call_timeout

MAX_PARALLEL_CHUNK_WRITES = 8


@dataclass(eq=False)
class ChainWriter(StoragePart):
    # writes awaiting a head, cancelled if their chain changes (`routing_changed`)
    in_flight: ChainWatch = field(default_factory=ChainWatch)
    # concurrent writes to one head share a frame (client/write_batcher.py)
    batcher: WriteBatcher = field(init=False)

    def __post_init__(self) -> None:
        self.batcher = WriteBatcher(self.rpc, self.timeout)

    async def write(self, ino: int, layout: Layout, offset: int, data: Buffer) -> None:
        """Write *data* at *offset*; returns once every chunk piece is acknowledged."""
        view = memoryview(data)
        pieces = plan([(ino, layout, offset, len(view))])
        if len(pieces) == 1:
            await self.write_piece(ino, layout, pieces[0], view)
            return
        limit = trio.CapacityLimiter(MAX_PARALLEL_CHUNK_WRITES)
        async with trio.open_nursery() as nursery:
            for p in pieces:
                nursery.start_soon(self._write_limited, limit, ino, layout, p, view)

    async def _write_limited(
        self, limit: trio.CapacityLimiter, ino: int, layout: Layout, p: Piece, data: memoryview
    ) -> None:
        async with limit:
            await self.write_piece(ino, layout, p, data)

    async def write_piece(self, ino: int, layout: Layout, p: Piece, data: memoryview) -> None:
        """Write one chunk piece (its bytes are ``data[p.dst : p.dst + p.length]``)."""
        piece_data = data[p[4] : p[4] + p[3]]
        try:
            await retrying(
                f"write chunk {p[1].hex()}",
                functools.partial(self._to_head, layout, p, piece_data),
                budget=self.retry_budget,
                on_failure=self.refresh_routing,
            )
        finally:
            # what we cached of this chunk is older than this write (forgotten
            # after it: a read racing the write may have cached the old record)
            if self.local.in_use:
                self.local.forget(ino, [p[1]])

    async def _to_head(self, layout: Layout, p: Piece, data: memoryview) -> None:
        routing = self.routing.current
        chain = routing.chain(p[0])
        serving = routing.serving_targets(p[0])
        if not serving:
            raise FsError(errno.ENXIO, f"chain {p[0]} has no serving target")
        head = serving[0]
        # never give up before the head could answer for the rest of its chain
        timeout = max(self.timeout, chain_call_timeout(len(routing.write_targets(p[0]))))
        address = routing.target_address(head["id"])
        item = (head["id"], chain["id"], chain["version"], p[1], p[2], layout["chunk_size"], data)
        # a head that went silent is taken out of the chain by mgmtd: then
        # stop waiting for it and retry on the new head at once
        try:
            with self.in_flight.watching(chain["id"], chain["version"]) as watch:
                await self.batcher.write(address, item, timeout)
        except FsError as exc:
            if exc.code in TRANSIENT:
                self.replicas.failed(routing, head["id"], exc)
            raise
        if watch.cancelled_caught:
            raise FsError(errno.ESTALE, f"chain {chain['id']} changed during a write: retry")

    def routing_changed(self, routing: Routing) -> None:
        """A `RoutingCache` listener: writes to chains that changed stop
        waiting and are retried on the new chain."""
        self.in_flight.routing_changed(routing)
