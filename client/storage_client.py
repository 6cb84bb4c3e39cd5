"""Reading and writing file bytes on the storage daemons.

Reads are split at chunk boundaries, each range is given to one serving
replica of its chain, and all ranges bound for the same storage node travel
in ONE request; the requests to different nodes run concurrently. Writes go
to the head of each chunk's chain. Transient failures (a node restarting, a
stale routing map) are retried on a fresh routing map within a time budget.
"""

from __future__ import annotations

import errno
import logging
from collections import defaultdict
from collections.abc import Sequence

import trio

from shufflefs.client.layout import ChunkRange, chunk_ranges
from shufflefs.client.retry import retrying
from shufflefs.cluster.protocol import TargetInfo
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.protocol import StorageStub

log = logging.getLogger("shufflefs.client.storage")

MAX_PARALLEL_CHUNK_WRITES = 8


class StorageClient:
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        *,
        read_timeout: float = 10.0,
        write_timeout: float = 30.0,
        retry_budget: float = 30.0,
    ) -> None:
        self.rpc = rpc
        self.routing = routing
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.retry_budget = retry_budget
        self.outstanding: dict[int, int] = defaultdict(int)  # target id -> requests in flight

    def stub(self, address: str) -> StorageStub:
        return StorageStub(self.rpc, address, timeout=self.read_timeout)

    def pick_replica(self, routing: Routing, chain: int) -> TargetInfo:
        """The serving replica with the fewest requests in flight from us."""
        targets = routing.serving_targets(chain)
        if not targets:
            raise FsError(errno.ENXIO, f"chain {chain} has no serving target")
        return min(targets, key=lambda t: self.outstanding[t["id"]])

    async def _refresh(self, exc: FsError) -> None:
        await self.routing.refresh()

    # ---- reads ----------------------------------------------------------------

    async def read(self, ino: int, layout: Layout, offset: int, length: int) -> bytearray:
        """Exactly *length* bytes at *offset* (holes and chunk tails read as zeros;
        the caller clamps to the file size)."""
        buf = bytearray(length)
        if length:
            await self.read_into(ino, layout, offset, memoryview(buf))
        return buf

    async def read_into(self, ino: int, layout: Layout, offset: int, out: memoryview) -> None:
        pending = chunk_ranges(ino, layout, offset, len(out))

        async def attempt() -> None:
            nonlocal pending
            pending = await self._read_once(pending, offset, out)
            if pending:
                raise FsError(errno.ECONNRESET, f"{len(pending)} chunk ranges of file {ino} unread")

        await retrying(
            f"read ino={ino} off={offset}",
            attempt,
            budget=self.retry_budget,
            on_failure=self._refresh,
        )

    async def _read_once(
        self, ranges: Sequence[ChunkRange], base: int, out: memoryview
    ) -> list[ChunkRange]:
        """One round: a request per storage node. Returns the ranges that hit a
        transient failure (to retry); raises for a definitive one."""
        routing = self.routing.current
        groups: dict[str, list[tuple[ChunkRange, int]]] = defaultdict(list)
        for r in ranges:
            target = self.pick_replica(routing, r.chain)
            groups[routing.target_address(target["id"])].append((r, target["id"]))
        failed: list[ChunkRange] = []
        errors: list[FsError] = []

        async def one_node(address: str, items: list[tuple[ChunkRange, int]]) -> None:
            for _, tid in items:
                self.outstanding[tid] += 1
            try:
                lengths, payload = await self.stub(address).read(
                    [(tid, r.chunk, r.offset, r.length) for r, tid in items]
                )
            except FsError as exc:
                if exc.code in (errno.EINVAL, errno.EMSGSIZE):
                    errors.append(exc)
                else:
                    failed.extend(r for r, _ in items)
                    log.info("read from %s failed: %s", address, exc.message)
                return
            finally:
                for _, tid in items:
                    self.outstanding[tid] -= 1
            src = memoryview(payload)
            pos = 0
            for (r, tid), n in zip(items, lengths, strict=True):
                if n < 0:
                    errors.append(FsError(-n, f"reading chunk {r.chunk.hex()} on target {tid}"))
                    continue
                dst = r.file_offset - base
                out[dst : dst + n] = src[pos : pos + n]
                if n < r.length:  # past the chunk's end: zeros
                    out[dst + n : dst + r.length] = bytes(r.length - n)
                pos += n

        async with trio.open_nursery() as nursery:
            for address, items in groups.items():
                nursery.start_soon(one_node, address, items)
        if errors:
            raise errors[0]
        return failed

    # ---- writes ---------------------------------------------------------------

    async def write(self, ino: int, layout: Layout, offset: int, data: Buffer) -> None:
        """Write *data* at *offset*; returns once every chunk range is acknowledged."""
        view = memoryview(data)
        ranges = chunk_ranges(ino, layout, offset, len(view))
        if len(ranges) == 1:
            await self._write_range(layout, ranges[0], view)
            return
        limit = trio.CapacityLimiter(MAX_PARALLEL_CHUNK_WRITES)

        async def one(r: ChunkRange) -> None:
            async with limit:
                start = r.file_offset - offset
                await self._write_range(layout, r, view[start : start + r.length])

        async with trio.open_nursery() as nursery:
            for r in ranges:
                nursery.start_soon(one, r)

    async def _write_range(self, layout: Layout, r: ChunkRange, data: memoryview) -> None:
        async def attempt() -> None:
            routing = self.routing.current
            chain = routing.chain(r.chain)
            serving = routing.serving_targets(r.chain)
            if not serving:
                raise FsError(errno.ENXIO, f"chain {r.chain} has no serving target")
            head = serving[0]
            stub = StorageStub(self.rpc, routing.target_address(head["id"]), self.write_timeout)
            await stub.write(
                head["id"],
                chain["id"],
                chain["version"],
                r.chunk,
                r.offset,
                layout["chunk_size"],
                data,
            )

        await retrying(
            f"write chunk {r.chunk.hex()}",
            attempt,
            budget=self.retry_budget,
            on_failure=self._refresh,
        )
