"""Reads sent from the event loop's thread and answered on reply threads.

The FUSE mount's READs come in on pyfuse3's trio loop. Taking each one
through a trio task, the rpc client's waits and the loop's wake-ups costs
more than the read itself (docs/storage.md, "Thread channels and the
mount's fast READs"). Here reads are planned and sent without waiting for
anything: `ReadChannels.submit`
adds a read's chunk pieces to the current batch, and `flush` sends the
batch: the replicas are chosen for all its pieces at once (`Replicas.assign`,
as for any batch: a chain with few pieces gets one replica, one with many
is spread over the equally good ones), the pieces bound for one storage
node go in one request frame (cut only where the wire limits demand), and
each node's frames leave in one ``sendmsg`` that does not wait
(``MSG_DONTWAIT``: the caller is the event loop's thread). Each storage
node's connection has a reply thread that blocks on it, receives each reply
straight into the buffers of the reads it serves and, once a read's last
reply is in, calls the read's ``done`` from that thread. The connections
ask their servers for thread channels (rpc/channel.py), so neither side runs
an event loop for a read; a server without channels serves them as
ordinary connections.

This is the fast path only. Anything unusual fails the read and ``done``
says so: a node without a connection (one is opened in the background), a
send that would wait, a failed item (a replica that is not serving, a
checksum error), a reply not in by the deadline, a broken connection. The
caller then reads through the read engine (client/read_engine.py), which
fails over, retries and reports; the replicas that failed are in
``ChannelRead.failures`` so it can avoid them.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shufflefs.client.layout import Piece
from shufflefs.client.read_engine import FAILOVER_READ_TIMEOUT, split_requests
from shufflefs.client.replicas import Replicas
from shufflefs.cluster.routing import Routing
from shufflefs.rpc import framing
from shufflefs.rpc.blocking import CHANNEL_CALL_ID, open_frames
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.frame_socket import FrameSocket

log = logging.getLogger("shufflefs.client.channel_reads")

TICK = 0.1  # s: how often an idle reply thread checks its deadlines
RECONNECT_AFTER = 1.0  # s before a node whose connection failed is tried again
CONNECT_TIMEOUT = 3.0
NOT_CONNECTED = errno.ENOTCONN  # a failure that says nothing about the replica


class ChannelRead:
    """One read in flight: its pieces and the buffer they land in, its
    frames still out, the replicas that failed it, what to call when over."""

    __slots__ = ("done", "failures", "out", "pieces", "remaining", "started")

    def __init__(
        self, pieces: list[Piece], out: memoryview, done: Callable[[ChannelRead], None]
    ) -> None:
        self.pieces = pieces
        self.out = out
        self.done = done
        # frames still out, plus one held by `flush` until every frame of its
        # batch is registered (so no reply can finish the read early)
        self.remaining = 1
        self.failures: list[tuple[int, int]] = []  # (target id, errno)
        self.started = time.perf_counter()

    @property
    def ok(self) -> bool:
        return not self.failures


Item = tuple[Piece, int, ChannelRead]  # a piece, the target it is read from, its read


class _Request:
    """One request frame: its items, the reads they belong to, its deadline."""

    __slots__ = ("deadline", "items", "reads")

    def __init__(self, items: list[Item], deadline: float) -> None:
        self.items = items
        self.reads = list({id(r): r for _, _, r in items}.values())
        self.deadline = deadline


def land(request: _Request, lengths: Any, size: int) -> list[memoryview] | None:
    """Where a reply of *size* payload bytes lands: each item's bytes
    straight into its read's buffer (zeros past a chunk's end are written
    here); None when the lengths do not fit the items and the payload."""
    if (
        not isinstance(lengths, list)
        or len(lengths) != len(request.items)
        or not all(type(n) is int for n in lengths)
        or sum(n for n in lengths if n > 0) != size
    ):
        return None
    views = []
    for (p, _, read), n in zip(request.items, lengths, strict=True):
        if n < 0:
            continue
        dst = p[4]
        if n:
            views.append(read.out[dst : dst + n])
        if n < p[3]:
            read.out[dst + n : dst + p[3]] = bytes(p[3] - n)
    return views


class NodeChannel:
    """The connection to one storage node and its reply thread."""

    def __init__(self, owner: ReadChannels, address: str) -> None:
        self.owner = owner
        self.address = address
        self.lock = threading.Lock()  # pending and broken, against `fail`
        self.pending: dict[int, _Request] = {}
        self.outbox: list[bytes] = []  # request frames registered, not yet sent
        self.queued: list[int] = []  # their call ids
        self.next_id = CHANNEL_CALL_ID + 1
        self.frames: FrameSocket | None = None
        self.broken = False
        self.thread: threading.Thread | None = None

    def connect(self) -> None:
        """Open the connection (blocking: on a connector thread) and start
        the reply thread."""
        self.frames, channel = open_frames(
            self.address,
            self.owner.secret,
            CONNECT_TIMEOUT,
            channel=True,
            tick=TICK,
            on_idle=self.check_deadlines,
        )
        self.frames.timeout = self.owner.timeout
        if not channel:
            log.info("%s has no thread channels: reads go to its event loop", self.address)
        self.thread = threading.Thread(
            target=self._replies, name=f"channel-reads {self.address}", daemon=True
        )
        self.thread.start()

    # ---- the event loop's thread -------------------------------------------

    def register(self, request: _Request) -> bool:
        """Register one request frame for the next `send` (each of its
        reads now waits for it); False if this connection is broken."""
        call_id = self.next_id
        self.next_id += 1
        body = framing.request_body(
            call_id, "read", {"items": [[tid, p[1], p[2], p[3]] for p, tid, _ in request.items]}
        )
        counted = self.owner.lock  # counted first: a `fail` may end the request at once
        with counted:
            for read in request.reads:
                read.remaining += 1
        with self.lock:
            registered = not self.broken and self.frames is not None
            if registered:
                self.pending[call_id] = request
        if not registered:
            with counted:
                for read in request.reads:
                    read.remaining -= 1  # never to 0: `flush` holds each read
            return False
        self.outbox.append(framing.pack_header(len(body), 0) + body)
        self.queued.append(call_id)
        return True

    def send(self) -> None:
        """Send the registered frames in one go, without waiting. If the
        socket takes none of them (its buffer is full: the node is not
        reading) they fail and are read another way; if it takes part of
        one, the stream is out of sync and the connection is closed."""
        frames = self.frames
        out, self.outbox = self.outbox, []
        queued, self.queued = self.queued, []
        if not out or frames is None:
            return
        try:
            sent = frames.sock.sendmsg(out, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.fail(f"send failed: {exc}")
            return
        if sent == sum(len(f) for f in out):
            return
        if sent:  # a half-sent frame
            self.fail("send would have waited mid-frame")
            return
        with self.lock:
            unsent = [r for r in (self.pending.pop(i, None) for i in queued) if r is not None]
        for request in unsent:
            self.owner.failed(request, errno.EAGAIN)

    # ---- the reply thread ---------------------------------------------------

    def _place(self, body: dict[Any, Any], size: int) -> Sequence[memoryview] | None:
        request = self.pending.get(body.get("i"))  # type: ignore[arg-type]
        result = body.get("r")
        if request is None or "e" in body or not isinstance(result, dict):
            return None
        return land(request, result.get("lengths"), size)

    def _replies(self) -> None:
        frames = self.frames
        assert frames is not None
        try:
            while not self.broken:
                body, payload, placed = frames.receive_frame(self._place, idle=True)
                call_id = body.get("i")
                with self.lock:
                    request = self.pending.pop(call_id, None)  # type: ignore[arg-type]
                if request is not None:
                    try:
                        self.owner.answered(request, body, placed, empty=payload is None)
                    except Exception:  # never leave its reads unanswered
                        log.exception("a reply from %s could not be handled", self.address)
                        self.owner.failed(request, errno.EIO)
                elif call_id == 0 and "e" in body:  # the server refused a frame
                    raise FsError.from_wire(body["e"])
                self.check_deadlines()
        except FsError as exc:
            self.fail(exc.message)
        except Exception:
            log.exception("reply thread of %s failed", self.address)
            self.fail("reply thread failed")

    def check_deadlines(self) -> None:
        """Give up the requests past their deadline (their replies, if they
        come, are dropped): their reads fail over to another replica."""
        now = time.monotonic()
        with self.lock:
            late = [self.pending.pop(i) for i, r in list(self.pending.items()) if r.deadline <= now]
        for request in late:
            self.owner.failed(request, errno.ETIMEDOUT)

    def fail(self, why: str) -> None:
        """The connection is unusable: close it, fail what is in flight."""
        with self.lock:
            first = not self.broken
            self.broken = True
            pending, self.pending = self.pending, {}
        if first:
            log.info("read channel to %s closed: %s", self.address, why)
        if self.frames is not None:
            self.frames.shutdown()
        self.owner.forget(self)
        for request in pending.values():
            self.owner.failed(request, errno.ECONNRESET)


class ReadChannels:
    """The reply-thread read path of one client (see the module docstring).
    *replicas* is the client's replica bookkeeping: the choice, and the
    requests in flight per target it weighs (counted here too)."""

    def __init__(
        self, secret: bytes, replicas: Replicas, *, timeout: float = FAILOVER_READ_TIMEOUT
    ) -> None:
        self.secret = secret
        self.replicas = replicas
        self.outstanding = replicas.outstanding
        self.timeout = timeout
        self.lock = threading.Lock()
        self.channels: dict[str, NodeChannel] = {}
        self.batch: list[ChannelRead] = []  # submitted, not yet flushed (event loop's thread)
        self._connecting: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._channels_gen = 0  # raised (under `lock`) whenever `channels` changes
        self._reach: tuple[Routing | None, int, dict[int, frozenset[int]]] = (None, -1, {})
        self.closed = False
        self.sent = 0  # reads sent (for tests and stats)
        self.failed_reads = 0

    def connected(self, routing: Routing, chains: Iterable[int]) -> bool:
        """Whether each of *chains* has a serving replica with a connection
        now (the replicas without one get one opened in the background, and
        `flush` chooses among those with one)."""
        ok = True
        for chain in chains:
            avoid = self._unreached(routing, chain)
            for tid in avoid:
                self._connect_later(routing.target_address(tid))
            if len(avoid) >= len(self.replicas.serving(routing, chain)):  # (none serving: False)
                ok = False
        return ok

    def _unconnected(self, routing: Routing, chains: Iterable[int]) -> dict[int, set[int]]:
        """Per chain, its serving replicas without a connection (not chosen)."""
        avoid: dict[int, set[int]] = defaultdict(set)
        for chain in chains:
            unreached = self._unreached(routing, chain)
            if unreached:
                avoid[chain].update(unreached)
        return avoid

    def _unreached(self, routing: Routing, chain: int) -> frozenset[int]:
        """The serving replicas of *chain* without a connection, remembered
        per routing snapshot and set of connections (every READ asks, for
        each of its chains; they change seldom)."""
        gen = self._channels_gen  # (before the look: a change meanwhile is seen next time)
        snapshot, seen, memo = self._reach
        if snapshot is not routing or seen != gen:
            memo = {}
            self._reach = (routing, gen, memo)
        avoid = memo.get(chain)
        if avoid is None:
            avoid = memo[chain] = frozenset(
                t["id"]
                for t in self.replicas.serving(routing, chain)
                if routing.target_address(t["id"]) not in self.channels
            )
        return avoid

    def submit(
        self, pieces: list[Piece], out: memoryview, done: Callable[[ChannelRead], None]
    ) -> ChannelRead:
        """Add a read (its chunk pieces, landing in *out*) to the batch that
        the next `flush` sends; *done* is called once, from a reply thread
        (or from `flush`, if it fails to go out)."""
        read = ChannelRead(pieces, out, done)
        self.batch.append(read)
        return read

    def flush(self, routing: Callable[[], Routing]) -> None:
        """Send the batch (event loop's thread) by the routing map *routing*
        gives now: replicas chosen for all its
        pieces at once, one frame per storage node (as the wire limits
        allow), every frame registered before any is sent. Never raises:
        whatever goes wrong fails the reads concerned (their ``done`` says
        so), so that none is left unanswered."""
        batch, self.batch = self.batch, []
        if not batch:
            return
        try:
            self._send_batch(routing(), batch)
        except Exception as exc:
            log.exception("sending a batch of %d reads failed", len(batch))
            with self.lock:
                for read in batch:
                    read.failures.append((-1, getattr(exc, "errno", None) or errno.EIO))
        for read in batch:  # the hold: now only replies can end them
            self._release(read)

    def _send_batch(self, routing: Routing, batch: list[ChannelRead]) -> None:
        owner = {id(p): r for r in batch for p in r.pieces}
        pieces = [p for r in batch for p in r.pieces]
        deadline = time.monotonic() + self.timeout
        avoid = self._unconnected(routing, {p[0] for p in pieces})
        try:
            groups = self.replicas.assign(routing, pieces, avoid or None)
        except FsError as exc:  # a chain with no serving replica: the slow path says so
            groups = {}
            with self.lock:
                for read in batch:
                    read.failures.append((-1, exc.code))
        used: list[NodeChannel] = []
        for address, placed in groups.items():
            channel = self.channels.get(address)
            for part in split_requests(placed) if len(placed) > 1 else [placed]:
                items = [(p, tid, owner[id(p)]) for p, tid in part]
                for _, tid, _ in items:
                    self.outstanding.add(tid, 1)
                request = _Request(items, deadline)
                if channel is not None and channel.register(request):
                    continue
                self._connect_later(address)
                failures = [(read, (tid, NOT_CONNECTED)) for _, tid, read in items]
                self._finish(request, failures, held=True)
            if channel is not None:
                used.append(channel)
        for channel in used:
            channel.send()
        self.sent += len(batch)

    # ---- the reply threads --------------------------------------------------

    def answered(self, request: _Request, body: dict[Any, Any], placed: bool, empty: bool) -> None:
        """A reply is in: its failed items noted. *placed*: its payload went
        into place; *empty*: it had none (nothing to place but the zeros of
        short items); neither: it did not fit its lengths."""
        if "e" in body:
            self.failed(request, FsError.from_wire(body["e"]).code)
            return
        result = body.get("r")
        lengths = result.get("lengths") if isinstance(result, dict) else None
        if not isinstance(lengths, list) or not (
            placed or (empty and land(request, lengths, 0) is not None)
        ):
            self.failed(request, errno.EPROTO)
            return
        self._finish(
            request,
            [
                (read, (tid, -n if isinstance(n, int) else errno.EPROTO))
                for (_, tid, read), n in zip(request.items, lengths, strict=True)
                if not isinstance(n, int) or n < 0
            ],
        )

    def failed(self, request: _Request, code: int) -> None:
        self._finish(request, [(read, (tid, code)) for _, tid, read in request.items])

    def _finish(
        self,
        request: _Request,
        failures: list[tuple[ChannelRead, tuple[int, int]]],
        held: bool = False,
    ) -> None:
        """One request frame is over: its reads that have nothing else out
        are done. *held*: it never went out (its reads are still held)."""
        for _, tid, _ in request.items:
            self.outstanding.add(tid, -1)
        ended = []
        with self.lock:
            for read, failure in failures:
                read.failures.append(failure)
            if not held:
                for read in request.reads:
                    read.remaining -= 1
                    if read.remaining == 0:
                        ended.append(read)
        for read in ended:
            self._end(read)

    def _release(self, read: ChannelRead) -> None:
        with self.lock:
            read.remaining -= 1
            ended = read.remaining == 0
        if ended:
            self._end(read)

    def _end(self, read: ChannelRead) -> None:
        if read.failures:
            self.failed_reads += 1
        try:
            read.done(read)
        except Exception:
            log.exception("the end of a read could not be handled")

    # ---- connections -----------------------------------------------------

    def _connect_later(self, address: str) -> None:
        with self.lock:
            if (
                self.closed
                or address in self._connecting
                or self._retry_at.get(address, 0.0) > time.monotonic()
            ):
                return
            self._connecting.add(address)
        threading.Thread(
            target=self._connect, args=(address,), name=f"channel-connect {address}", daemon=True
        ).start()

    def _connect(self, address: str) -> None:
        channel = NodeChannel(self, address)
        try:
            channel.connect()
        except FsError as exc:
            log.info("no read channel to %s: %s", address, exc.message)
            with self.lock:
                self._retry_at[address] = time.monotonic() + RECONNECT_AFTER
            return
        finally:
            with self.lock:
                self._connecting.discard(address)
        with self.lock:
            if self.closed:
                channel.broken = True
            else:
                self.channels[address] = channel
                self._channels_gen += 1
        if channel.broken:
            channel.fail("closing")

    def forget(self, channel: NodeChannel) -> None:
        with self.lock:
            if self.channels.get(channel.address) is channel:
                del self.channels[channel.address]
                self._channels_gen += 1
            self._retry_at[channel.address] = time.monotonic() + RECONNECT_AFTER

    def close(self) -> None:
        """Close every connection; reads in flight fail (their ``done`` is
        called) and reply threads end. Returns once they did."""
        with self.lock:
            self.closed = True
            channels = list(self.channels.values())
        for channel in channels:
            channel.fail("closing")
        for channel in channels:
            if channel.thread is not None and channel.thread is not threading.current_thread():
                channel.thread.join(timeout=5.0)
