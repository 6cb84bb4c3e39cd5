"""The read engine: chunk pieces to the storage daemons, with failover.

`ReadEngine.read` takes planned pieces (`layout.plan`) and reads them in
rounds (`ReadJob.round`, retried by `rpc.retry.retrying`): each round chooses
one replica per piece (`Replicas.assign`), serves local replicas from their
chunk files first, and sends all pieces bound for one storage node in ONE
request (cut only where the wire limits demand; `ReadJob.request`), the
requests to different nodes concurrently; concurrent reads bound for one node
share its frames (`ReadBatcher`). The same engine serves one `pread` and a
whole training batch of ranges over many files.

Failures: a replica that fails (dead, cut off, or a block whose checksum did
not match) is avoided for the rest of the read and for a few seconds after
(`Replicas.failed`), and its pieces are read again from another replica in the
next round. The caller sees an error only when no replica can serve.
"""

from __future__ import annotations

import errno
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from shufflefs.client.layout import Piece
from shufflefs.client.read_batcher import MAX_REQUEST_BYTES, MAX_REQUEST_ITEMS, ReadBatcher
from shufflefs.client.replicas import Placed
from shufflefs.client.storage_parts import StoragePart
from shufflefs.cluster.routing import Routing
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import TRANSIENT, Backoff, retrying
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.uring import UringReads, for_this_run

log = logging.getLogger("shufflefs.client.reads")

FAILOVER_READ_TIMEOUT = 1.5  # a read with another replica to try gives up on one this soon
INLINE_WAIT_MAX = 0  # other reads in flight above which a disk wait goes to a thread
LOCAL_READ_THREADS = 16  # short-circuit reads that must wait for the disk


def split_requests(items: list[Placed]) -> list[list[Placed]]:
    """Cut one node's items into requests within the wire limits."""
    requests: list[list[Placed]] = []
    current: list[Placed] = []
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
    items: Sequence[Placed], lengths: Sequence[int], payload: Buffer, out: memoryview
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


def landing_views(
    items: Sequence[Placed], lengths: Sequence[int], payload_len: int, out: memoryview
) -> list[memoryview] | None:
    """Where the bytes of a read reply go in *out*, in payload order, so the
    reply can be received straight into place (no copy); zeros past a short
    item are written here. None when the lengths do not add up to the payload
    (then it is received and checked the ordinary way)."""
    if len(lengths) != len(items) or sum(n for n in lengths if n > 0) != payload_len:
        return None
    views = []
    for (p, _), n in zip(items, lengths, strict=True):
        if n < 0:
            continue
        dst = p[4]
        if n:
            views.append(out[dst : dst + n])
        if n < p[3]:
            out[dst + n : dst + p[3]] = bytes(p[3] - n)
    return views


@dataclass(eq=False)
class ReadEngine(StoragePart):
    reads_in_flight: int = 0
    # a lone cold local read may wait for the disk inline (`read_local_now`);
    # off in a FUSE mount, whose loop cannot see the READs queued behind it
    # in the kernel: each would wait for the disk one after the other
    inline_disk_waits: bool = True
    local_threads: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(LOCAL_READ_THREADS)
    )
    batcher: ReadBatcher = field(init=False)

    def __post_init__(self) -> None:
        self.batcher = ReadBatcher(self.rpc, self.timeout)

    def read_local_now(self, pieces: list[Piece], out: memoryview) -> list[Piece]:
        """The fast path, inline: the pieces a local chunk file serves now
        (waiting for the disk here only for a lone one-chunk read, when no
        other read is in flight: a thread hop would cost more). Returns the rest."""
        wait = (
            self.inline_disk_waits and len(pieces) == 1 and self.reads_in_flight <= INLINE_WAIT_MAX
        )
        return self.local.read_pieces(pieces, out, wait)

    async def read(self, pieces: list[Piece], out: memoryview, cold: bool = False) -> None:
        """Read *pieces* into *out*, through every failure a replica can heal.
        *cold* (bytes not expected in the page cache): local chunk files go
        straight to a worker thread, which starts every file's readahead
        before it waits for the first; an attempt on the event loop first
        (`LocalTarget.read` with RWF_NOWAIT) would fail, but only after
        starting that readahead itself: the allocation of the pages and the
        submission of the I/O, a quarter of a cold prefetch's loop time
        (measured with perf on the mount's loop thread)."""
        if not pieces:
            return
        job = ReadJob(self, pieces, out, cold)
        self.reads_in_flight += 1
        try:
            try:  # the first round as it is: no retry loop set up for a read that succeeds
                await job.round()
                return
            except FsError as exc:
                if exc.code not in TRANSIENT:
                    raise
                backoff = Backoff()
                delay = backoff.next()
                log.info("read of %d chunk ranges failed (%s); retrying", len(pieces), exc.message)
                try:
                    await self.refresh_routing(exc)
                except FsError as inner:
                    log.debug("refreshing the routing map failed: %s", inner.message)
                await trio.sleep(delay)
            await retrying(
                f"read of {len(pieces)} chunk ranges",
                job.round,
                budget=self.retry_budget - delay,
                on_failure=self.refresh_routing,
                backoff=backoff,
            )
        finally:
            self.reads_in_flight -= 1


class ReadJob:
    """One read in progress: the pieces still unread, and per chain the
    replicas that failed this read (never asked again by it)."""

    def __init__(
        self, engine: ReadEngine, pieces: list[Piece], out: memoryview, cold: bool = False
    ) -> None:
        self.engine = engine
        self.pending = pieces
        self.out = out
        self.cold = cold
        self.avoid: dict[int, set[int]] = defaultdict(set)
        self.routing: Routing = engine.routing.current
        self.retry: list[Piece] = []  # of this round: to read again from another replica
        self.errors: list[FsError] = []  # of this round: definitive failures

    async def round(self) -> None:
        """One round: the pending pieces grouped per storage node, local chunk
        files first (inline), then one request per node, all at once. Raises a
        definitive failure, or a transient one when pieces remain to retry."""
        engine = self.engine
        routing = self.routing = engine.routing.current
        groups = engine.replicas.assign(routing, self.pending, self.avoid)
        self.retry, self.errors = [], []
        remote: list[tuple[str, list[Placed]]] = []
        slow: list[tuple[str, list[Placed]]] = []
        local = engine.replicas.local_targets(routing) if engine.local.enabled else frozenset()
        for address, items in groups.items():
            if local and items[0][1] in local and engine.local.target(routing, items[0][1]):
                if not self.cold:
                    items = engine.local.read_placed(routing, items, self.out, nowait=True)
                if items:
                    slow.append((address, items))
                continue
            if len(items) == 1:
                remote.append((address, items))
            else:
                remote.extend((address, request) for request in split_requests(items))
        alone = not remote and len(slow) == 1 and engine.reads_in_flight <= 1
        if slow and alone and engine.inline_disk_waits:
            # alone and local: wait for the disk right here; a thread hop costs
            # more than the read, and nobody else is kept waiting (as far as
            # this loop can see: not in a FUSE mount, see `inline_disk_waits`)
            address, items = slow.pop()
            items = engine.local.read_placed(routing, items, self.out, nowait=False)
            remote.extend((address, request) for request in split_requests(items))
        if len(remote) == 1 and not slow:
            await self.request(*remote[0])
        elif remote or slow:
            async with trio.open_nursery() as nursery:
                for address, request in remote:
                    nursery.start_soon(self.request, address, request)
                ring = for_this_run() if self.cold else None
                for address, items in slow:
                    if ring is not None:
                        nursery.start_soon(self.local_in_ring, address, items, ring)
                    else:
                        nursery.start_soon(self.local_in_thread, address, items)
        if self.errors:
            raise self.errors[0]
        self.pending = self.retry
        if self.pending:
            raise FsError(errno.ECONNRESET, f"{len(self.pending)} chunk ranges unread")

    async def request(self, address: str, items: list[Placed]) -> None:
        """One read request to one storage node; its bytes into place, and
        every item that failed sorted into retry or error."""
        engine = self.engine
        for _, tid in items:
            engine.replicas.outstanding.add(tid, 1)
        # With another replica to fall back on, do not wait out the full
        # timeout on one that went silent (a cut link resets nothing).
        chain = items[0][0][0]
        avoided = self.avoid.get(chain)
        others = len(engine.replicas.serving(self.routing, chain)) > 1 + len(avoided or ())
        timeout = min(engine.timeout, FAILOVER_READ_TIMEOUT) if others else engine.timeout
        try:
            lengths, payload = await engine.batcher.read(
                address, [(tid, p[1], p[2], p[3]) for p, tid in items], timeout
            )
        except FsError as exc:
            if exc.code in (errno.EINVAL, errno.EMSGSIZE):
                self.errors.append(exc)
            else:
                log.info("read from %s failed: %s", address, exc.message)
                for p, tid in items:
                    self.bad_replica(p, tid, exc)
            return
        finally:
            for _, tid in items:
                engine.replicas.outstanding.add(tid, -1)
        for p, tid, code in scatter(items, lengths, payload, self.out):
            item_error = FsError(code, f"reading chunk {p[1].hex()} on target {tid}")
            if code == errno.EIO:  # a checksum failed: never the bytes; another replica
                log.warning("%s; trying another replica", item_error.message)
                self.bad_replica(p, tid, item_error)
            elif code in TRANSIENT:
                self.bad_replica(p, tid, item_error)
            else:
                self.errors.append(item_error)

    async def local_in_thread(self, address: str, items: list[Placed]) -> None:
        """Local chunk files whose bytes are not in the page cache: in a
        thread (still cheaper than the daemon); the daemon for what fails."""
        engine = self.engine
        async with engine.local_threads:
            rest = await trio.to_thread.run_sync(
                engine.local.read_placed, self.routing, items, self.out, False, self.cold
            )
        for request in split_requests(rest):
            await self.request(address, request)

    async def local_in_ring(self, address: str, items: list[Placed], ring: UringReads) -> None:
        """A cold read's local chunk files through the loop's io_uring
        (`LocalReads.read_cold`); the daemon for what fails."""
        rest = await self.engine.local.read_cold(self.routing, items, self.out, ring)
        for request in split_requests(rest):
            await self.request(address, request)

    def bad_replica(self, piece: Piece, tid: int, exc: FsError) -> None:
        """Read the piece elsewhere next round if the chain has a replica not
        yet tried (or the failure may heal); else it is a definitive error."""
        chain = piece[0]
        self.avoid[chain].add(tid)
        self.engine.replicas.failed(self.routing, tid, exc)
        others = [
            t
            for t in self.engine.replicas.serving(self.routing, chain)
            if t["id"] not in self.avoid[chain]
        ]
        if others or exc.code in TRANSIENT:
            self.retry.append(piece)
        else:
            self.errors.append(exc)
