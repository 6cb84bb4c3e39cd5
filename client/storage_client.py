"""Reading and writing file bytes on the storage daemons.

Reads: every requested range is split at chunk boundaries, each piece goes to
one serving replica of its chain (the one with the fewest requests in flight
from us), and all pieces bound for the same storage node travel in ONE
request (cut only where the wire limits demand); the requests to different
nodes run concurrently. The same engine serves one `pread` and a whole
training batch of ranges over many files.

Failures: a replica that fails (dead, cut off, or a block whose checksum did
not match) is avoided for the rest of the read and for a few seconds after,
its pieces are read again from another replica, and mgmtd is told so that it
can take a dead node out of its chains at once rather than after the
heartbeat timeout. The caller sees an error only when no replica can serve.

Writes go to the head of each chunk's chain, which replicates down the chain
and acknowledges once every replica holds the data.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections import defaultdict
from collections.abc import Sequence

import trio

from shufflefs.client.layout import MAX_CHUNKS, ChunkRange, chunk_ranges
from shufflefs.cluster.protocol import TargetInfo
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.framing import DEFAULT_LIMITS
from shufflefs.rpc.retry import TRANSIENT, retrying
from shufflefs.rpc.runtime import hostname
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.local_read import LocalTarget
from shufflefs.storage.protocol import StorageStub, chunk_id

log = logging.getLogger("shufflefs.client.storage")

MAX_PARALLEL_CHUNK_WRITES = 8
SUSPECT_SECONDS = 5.0  # how long a replica that failed is avoided
FAILOVER_READ_TIMEOUT = 1.5  # a read with another replica to try gives up on one this soon
REMOTE_PENALTY = 2  # a replica on another host counts as this many requests busier
INLINE_WAIT_MAX = 0  # other reads in flight above which a disk wait goes to a thread
SPREAD_THRESHOLD = 8  # pieces of one chain in a batch from which they go to every replica
LOCAL_READ_THREADS = 16  # short-circuit reads that must wait for the disk
REPORT_INTERVAL = 2.0  # at most one unreachable-report per node per interval
# Well under the reply payload limit (64 MiB) and the request body limit
# (1 MiB of msgpack, about 30 bytes per item), so no request is refused.
MAX_REQUEST_BYTES = min(16 << 20, DEFAULT_LIMITS.max_payload // 2)
MAX_REQUEST_ITEMS = 8192

Extent = tuple[int, Layout, int, int]  # (inode, layout, offset, length)
# (chain, chunk id, offset in the chunk, length, where the bytes go in the output)
Piece = tuple[int, bytes, int, int, int]


def plan(extents: Sequence[Extent]) -> list[Piece]:
    """The chunk pieces of *extents*, each with the position its bytes take
    in the output buffer (ranges laid end to end). Plain tuples and inline
    arithmetic: a batch is thousands of extents, and this runs per batch."""
    pieces: list[Piece] = []
    append = pieces.append
    dst = 0
    for ino, layout, offset, length in extents:
        if offset < 0 or length < 0:
            raise FsError(errno.EINVAL, "negative offset or length")
        size = layout["chunk_size"]
        chains = layout["chains"]
        if not chains:
            raise FsError(errno.EIO, f"file {ino} has a layout without chains")
        pos, end = offset, offset + length
        while pos < end:
            index = pos // size
            if index >= MAX_CHUNKS:
                raise FsError(errno.EFBIG, "offset beyond the largest possible file")
            within = pos - index * size
            n = min(size - within, end - pos)
            append(
                (chains[index % len(chains)], chunk_id(ino, index), within, n, dst + pos - offset)
            )
            pos += n
        dst += length
    return pieces


def split_requests(items: list[tuple[Piece, int]]) -> list[list[tuple[Piece, int]]]:
    """Cut one node's items into requests within the wire limits."""
    requests: list[list[tuple[Piece, int]]] = []
    current: list[tuple[Piece, int]] = []
    size = 0
    for item in items:
        n = item[0][3]
        if current and (size + n > MAX_REQUEST_BYTES or len(current) >= MAX_REQUEST_ITEMS):
            requests.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        requests.append(current)
    return requests


def scatter(
    items: Sequence[tuple[Piece, int]], lengths: Sequence[int], payload: Buffer, out: memoryview
) -> list[tuple[Piece, int, int]]:
    """Copy one read reply into place (zeros past a chunk's end, as a hole
    reads); returns (piece, target, errno) of the items that failed."""
    src = memoryview(payload)
    failures: list[tuple[Piece, int, int]] = []
    pos = 0
    for (p, tid), n in zip(items, lengths, strict=True):
        if n < 0:
            failures.append((p, tid, -n))
            continue
        dst = p[4]
        out[dst : dst + n] = src[pos : pos + n]
        if n < p[3]:
            out[dst + n : dst + p[3]] = bytes(p[3] - n)
        pos += n
    return failures


class StorageClient:
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        *,
        read_timeout: float = 5.0,
        write_timeout: float = 30.0,
        retry_budget: float = 30.0,
        local_reads: bool = True,
    ) -> None:
        self.rpc = rpc
        self.routing = routing
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.retry_budget = retry_budget
        self.outstanding: dict[int, int] = defaultdict(int)  # target id -> requests in flight
        self.suspect: dict[int, float] = {}  # target id -> avoid until (monotonic)
        self._reported: dict[int, float] = {}  # node id -> when we last reported it
        self.background: trio.Nursery | None = None  # set by the owner, for reports
        self.host = hostname()
        self._local: tuple[int, frozenset[int]] = (-1, frozenset())
        self.local_reads = local_reads
        self.reads_in_flight = 0
        self.writes: set[tuple[int, int, trio.CancelScope]] = set()  # see _write_range
        self._salt = random.randrange(1 << 30)
        self._local_targets: dict[int, LocalTarget | None] = {}  # None: not readable here
        self._local_threads = trio.CapacityLimiter(LOCAL_READ_THREADS)

    def stub(self, address: str) -> StorageStub:
        return StorageStub(self.rpc, address, timeout=self.read_timeout)

    # ---- replica choice and failure bookkeeping ------------------------------

    def pick_replica(
        self, routing: Routing, chain: int, avoid: set[int] | frozenset[int] = frozenset()
    ) -> TargetInfo:
        """The serving replica with the fewest of our requests in flight,
        counting a replica on another host as REMOTE_PENALTY requests busier
        (a local one is cheaper to reach), and preferring replicas that have
        not failed lately."""
        targets = routing.serving_targets(chain)
        if not targets:
            raise FsError(errno.ENXIO, f"chain {chain} has no serving target")
        now = time.monotonic()
        healthy = [
            t for t in targets if t["id"] not in avoid and self.suspect.get(t["id"], 0) <= now
        ]
        untried = healthy or [t for t in targets if t["id"] not in avoid] or targets
        local = self.local_targets(routing)
        # ties go to a replica that depends on this process, so readers spread
        return min(
            untried,
            key=lambda t: (
                self.outstanding[t["id"]] + (0 if t["id"] in local else REMOTE_PENALTY),
                (t["id"] + self._salt) % 7919,
            ),
        )

    def local_targets(self, routing: Routing) -> frozenset[int]:
        """Targets on this host (cached per routing version)."""
        if self._local[0] != routing.version:
            hosts = {n["id"]: n["host"] for n in routing.nodes.values()}
            mine = frozenset(
                t for t, info in routing.targets.items() if hosts.get(info["node"]) == self.host
            )
            self._local = (routing.version, mine)
        return self._local[1]

    def local_target(self, routing: Routing, target_id: int) -> LocalTarget | None:
        """A short-circuit reader for a target on this host, if it can be used."""
        if not self.local_reads or target_id not in self.local_targets(routing):
            return None
        if target_id not in self._local_targets:
            info = routing.targets[target_id]
            try:
                reader: LocalTarget | None = LocalTarget(
                    info["path"], target_id, routing.cluster_id
                )
                log.info("short-circuit reads from target %d at %s", target_id, info["path"])
            except Exception as exc:  # unreadable here: always through the daemon
                log.info("no short-circuit reads from target %d: %s", target_id, exc)
                reader = None
            self._local_targets[target_id] = reader
        return self._local_targets[target_id]

    def read_local(
        self, routing: Routing, items: list[tuple[Piece, int]], out: memoryview, nowait: bool
    ) -> list[tuple[Piece, int]]:
        """Serve what can be served from local chunk files; returns the rest."""
        rest: list[tuple[Piece, int]] = []
        for item in items:
            p, tid = item
            local = self.local_target(routing, tid)
            data = None if local is None else local.read(p[1], p[2], p[3], nowait)
            if data is None:
                rest.append(item)
                continue
            n = len(data)
            out[p[4] : p[4] + n] = data
            if n < p[3]:
                out[p[4] + n : p[4] + p[3]] = bytes(p[3] - n)
        return rest

    def forget_local(self, ino: int, cids: Sequence[bytes] | None = None) -> None:
        """Cached chunk records of a file may be stale (it was opened again,
        written or cut): the next local read looks them up afresh."""
        for reader in self._local_targets.values():
            if reader is not None:
                if cids is None:
                    reader.forget_file(ino)
                else:
                    reader.forget(cids)

    def read_local_fast(self, ino: int, layout: Layout, offset: int, length: int) -> bytes | None:
        """The fast path of a small read: within one chunk, a replica on this
        host, served from its chunk file without a task or a message (waiting
        for the disk inline only when no other read is in flight). None when
        the general path must run."""
        if not self.local_reads:
            return None
        size = layout["chunk_size"]
        index = offset // size
        within = offset - index * size
        if within + length > size or length <= 0 or index >= MAX_CHUNKS:
            return None
        chains = layout["chains"]
        routing = self.routing.current
        local = self.local_targets(routing)
        if not local:
            return None
        chain = chains[index % len(chains)]
        for t in routing.serving_targets(chain):
            if t["id"] in local:
                reader = self.local_target(routing, t["id"])
                if reader is None:
                    return None
                cid = chunk_id(ino, index)
                data = reader.read(cid, within, length, nowait=True)
                if data is None and self.reads_in_flight <= INLINE_WAIT_MAX:
                    data = reader.read(cid, within, length, nowait=False)
                if data is None:
                    return None
                if len(data) < length:  # past the chunk's end: zeros
                    return bytes(data) + bytes(length - len(data))
                return bytes(data)
        return None

    def routing_changed(self, routing: Routing) -> None:
        """Stop waiting on writes sent to chains that changed since (a
        `RoutingCache` listener): they are retried on the new chain."""
        for chain, version, scope in list(self.writes):
            info = routing.chains.get(chain)
            if info is None or info["version"] != version:
                scope.cancel()

    def failed(self, routing: Routing, target_id: int, exc: FsError) -> None:
        """A replica failed us: avoid it for a while; if it looked dead, tell
        mgmtd (which checks for itself before taking it out)."""
        self.suspect[target_id] = time.monotonic() + SUSPECT_SECONDS
        if exc.code not in TRANSIENT or exc.code in (errno.ESTALE, errno.ENXIO):
            return
        try:
            node = routing.node_of_target(target_id)["id"]
        except FsError:
            return
        now = time.monotonic()
        if self.background is None or now - self._reported.get(node, -1e9) < REPORT_INTERVAL:
            return
        self._reported[node] = now
        self.background.start_soon(self._report, node)

    async def _report(self, node: int) -> None:
        try:
            if await self.routing.mgmtd.report_unreachable(0, node):
                log.warning("storage node %d reported unreachable; mgmtd took it out", node)
                await self.routing.refresh()
        except FsError as exc:
            log.info("reporting node %d unreachable failed: %s", node, exc.message)

    def assign(
        self, routing: Routing, pieces: Sequence[Piece], avoid: dict[int, set[int]] | None = None
    ) -> dict[str, list[tuple[Piece, int]]]:
        """Group pieces per storage node. A chain with few pieces in the batch
        gets one replica (one request); one with many has its pieces dealt
        round robin over the equally good replicas, so a big batch keeps
        every replica's disk busy instead of one."""
        per_chain: dict[int, list[Piece]] = defaultdict(list)
        for piece in pieces:
            per_chain[piece[0]].append(piece)
        groups: dict[str, list[tuple[Piece, int]]] = defaultdict(list)
        for chain, chain_pieces in per_chain.items():
            skip: set[int] | frozenset[int] = avoid[chain] if avoid else frozenset()
            if len(chain_pieces) < SPREAD_THRESHOLD:
                choices = [self.pick_replica(routing, chain, skip)]
            else:
                choices = self.equal_replicas(routing, chain, skip)
            places = [(routing.target_address(t["id"]), t["id"]) for t in choices]
            if len(places) == 1:
                address, tid = places[0]
                groups[address].extend((p, tid) for p in chain_pieces)
                continue
            for i, piece in enumerate(chain_pieces):
                address, tid = places[i % len(places)]
                groups[address].append((piece, tid))
        return groups

    def equal_replicas(
        self, routing: Routing, chain: int, avoid: set[int] | frozenset[int]
    ) -> list[TargetInfo]:
        """The replicas as good as the best one (same locality, not failing),
        in an order that differs between processes (so readers spread)."""
        best = self.pick_replica(routing, chain, avoid)
        local = self.local_targets(routing)
        now = time.monotonic()
        same = [
            t
            for t in routing.serving_targets(chain)
            if t["id"] not in avoid
            and self.suspect.get(t["id"], 0) <= now
            and (t["id"] in local) == (best["id"] in local)
        ] or [best]
        k = self._salt % len(same)
        return same[k:] + same[:k]

    async def _refresh(self, exc: FsError) -> None:
        await self.routing.refresh()

    # ---- reads ----------------------------------------------------------------

    async def read(self, ino: int, layout: Layout, offset: int, length: int) -> bytearray:
        """Exactly *length* bytes at *offset* (holes and chunk tails read as zeros;
        the caller clamps to the file size)."""
        buf = bytearray(length)
        if length:
            await self.read_extents_into([(ino, layout, offset, length)], memoryview(buf))
        return buf

    async def read_extents_into(self, extents: Sequence[Extent], out: memoryview) -> None:
        """Read *extents* into *out*, laid end to end in the order given. The
        caller clamps every extent to its file's size: bytes past the end of a
        chunk read as zeros, as a hole does."""
        total = sum(e[3] for e in extents)
        if len(out) < total:
            raise FsError(errno.EINVAL, f"output buffer of {len(out)} bytes for {total} bytes")
        out = out.cast("B") if out.format != "B" else out
        pending = plan(extents)
        self.reads_in_flight += 1
        try:
            await self._read_pending(extents, pending, out)
        finally:
            self.reads_in_flight -= 1

    async def _read_pending(
        self, extents: Sequence[Extent], pending: list[Piece], out: memoryview
    ) -> None:
        avoid: dict[int, set[int]] = defaultdict(set)  # chain -> replicas that failed this read

        async def attempt() -> None:
            nonlocal pending
            pending = await self._read_round(pending, out, avoid)
            if pending:
                raise FsError(errno.ECONNRESET, f"{len(pending)} chunk ranges unread")

        if pending:
            await retrying(
                f"read of {len(extents)} ranges",
                attempt,
                budget=self.retry_budget,
                on_failure=self._refresh,
            )

    async def _read_round(
        self, pieces: Sequence[Piece], out: memoryview, avoid: dict[int, set[int]]
    ) -> list[Piece]:
        """One round: the pieces grouped per storage node. Returns the pieces
        to read again (from another replica where there is one); raises for a
        definitive failure."""
        routing = self.routing.current
        groups = self.assign(routing, pieces, avoid)
        retry: list[Piece] = []
        errors: list[FsError] = []

        def bad_replica(piece: Piece, tid: int, exc: FsError) -> None:
            """Read the piece elsewhere if the chain has a replica not yet tried."""
            chain = piece[0]
            avoid[chain].add(tid)
            self.failed(routing, tid, exc)
            others = [t for t in routing.serving_targets(chain) if t["id"] not in avoid[chain]]
            if others or exc.code in TRANSIENT:
                retry.append(piece)
            else:
                errors.append(exc)

        async def one_request(address: str, items: list[tuple[Piece, int]]) -> None:
            for _, tid in items:
                self.outstanding[tid] += 1
            # With another replica to fall back on, do not wait out the full
            # timeout on one that went silent (a cut link resets nothing).
            others = any(
                len(routing.serving_targets(p[0])) > 1 + len(avoid[p[0]]) for p, _ in items[:1]
            )
            timeout = min(self.read_timeout, FAILOVER_READ_TIMEOUT) if others else None
            try:
                lengths, payload = await self.stub(address).read(
                    [(tid, p[1], p[2], p[3]) for p, tid in items], timeout=timeout
                )
            except FsError as exc:
                if exc.code in (errno.EINVAL, errno.EMSGSIZE):
                    errors.append(exc)
                else:
                    log.info("read from %s failed: %s", address, exc.message)
                    for p, tid in items:
                        bad_replica(p, tid, exc)
                return
            finally:
                for _, tid in items:
                    self.outstanding[tid] -= 1
            for p, tid, code in scatter(items, lengths, payload, out):
                item_error = FsError(code, f"reading chunk {p[1].hex()} on target {tid}")
                if code == errno.EIO:  # a checksum failed: never the bytes; another replica
                    log.warning("%s; trying another replica", item_error.message)
                    bad_replica(p, tid, item_error)
                elif code in TRANSIENT:
                    bad_replica(p, tid, item_error)
                else:
                    errors.append(item_error)

        async def local_slow(address: str, items: list[tuple[Piece, int]]) -> None:
            """Local chunk files whose bytes are not in the page cache: in a
            thread (still cheaper than the daemon); the daemon for what fails."""
            async with self._local_threads:
                rest = await trio.to_thread.run_sync(self.read_local, routing, items, out, False)
            for request in split_requests(rest):
                await one_request(address, request)

        # Local chunk files first, inline: everything in the page cache is
        # served without a task, a thread or a message.
        local = self.local_targets(routing) if self.local_reads else frozenset()
        remote: list[tuple[str, list[tuple[Piece, int]]]] = []
        slow: list[tuple[str, list[tuple[Piece, int]]]] = []
        for address, items in groups.items():
            if local and items[0][1] in local and self.local_target(routing, items[0][1]):
                items = self.read_local(routing, items, out, nowait=True)
                if items:
                    slow.append((address, items))
                continue
            remote.extend((address, request) for request in split_requests(items))
        if slow and not remote and len(slow) == 1 and self.reads_in_flight <= 1:
            # alone and local: wait for the disk right here; a thread hop costs
            # more than the read, and nobody else is kept waiting
            address, items = slow.pop()
            items = self.read_local(routing, items, out, nowait=False)
            remote.extend((address, request) for request in split_requests(items))
        if len(remote) == 1 and not slow:
            await one_request(*remote[0])
        elif remote or slow:
            async with trio.open_nursery() as nursery:
                for address, request in remote:
                    nursery.start_soon(one_request, address, request)
                for address, items in slow:
                    nursery.start_soon(local_slow, address, items)
        if errors:
            raise errors[0]
        return retry

    # ---- writes ---------------------------------------------------------------

    async def write(self, ino: int, layout: Layout, offset: int, data: Buffer) -> None:
        """Write *data* at *offset*; returns once every chunk range is acknowledged."""
        view = memoryview(data)
        ranges = chunk_ranges(ino, layout, offset, len(view))
        try:
            await self._write_ranges(layout, ranges, offset, view)
        finally:
            # what we cached of these chunks is older than this write (forgotten
            # after it: a read racing the write may have cached the old record)
            if self._local_targets:
                self.forget_local(ino, [r.chunk for r in ranges])

    async def _write_ranges(
        self, layout: Layout, ranges: list[ChunkRange], offset: int, view: memoryview
    ) -> None:
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
            # a head that went silent is taken out of the chain by mgmtd: then
            # stop waiting for it and retry on the new head at once
            watch = (chain["id"], chain["version"], trio.CancelScope())
            self.writes.add(watch)
            try:
                with watch[2]:
                    await stub.write(
                        head["id"],
                        chain["id"],
                        chain["version"],
                        r.chunk,
                        r.offset,
                        layout["chunk_size"],
                        data,
                    )
            except FsError as exc:
                if exc.code in TRANSIENT:
                    self.failed(routing, head["id"], exc)
                raise
            finally:
                self.writes.discard(watch)
            if watch[2].cancelled_caught:
                raise FsError(errno.ESTALE, f"chain {chain['id']} changed during a write: retry")

        await retrying(
            f"write chunk {r.chunk.hex()}",
            attempt,
            budget=self.retry_budget,
            on_failure=self._refresh,
        )
