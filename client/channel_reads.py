"""Reads sent from the event loop's thread and answered on reply threads.

The FUSE mount's READs come in on pyfuse3's trio loop. Taking each one
through a trio task, the rpc client's waits and the loop's wake-ups costs
more than the read itself (docs/storage.md, "Thread channels"). Here a read
is planned and sent without waiting for anything: `ReadChannels.submit`
queues one request per storage node and `flush` writes every queued request
of a node to its blocking socket in one ``sendmsg`` that does not wait
(``MSG_DONTWAIT``: the caller is the event loop's thread). Each storage node's
connection has a reply thread that blocks on it, receives each reply
straight into the read's buffer and, once a read's last reply is in, calls
the read's ``done`` from that thread. The connections ask their servers for
thread channels (rpc/channel.py), so neither side runs an event loop for a
read; a server without channels serves them as ordinary connections.

This is the fast path only. Anything unusual fails the read and ``done``
says so: a node without a connection yet (one is opened in the background,
and the read goes the ordinary way meanwhile), a send that would wait, a
failed item (a replica that is not serving, a checksum error), a reply not
in by the deadline, a broken connection. The caller then reads through the
read engine (client/read_engine.py), which fails over, retries and reports;
the replicas that failed are in ``ChannelRead.failures`` so it can avoid
them.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from shufflefs.client.read_engine import FAILOVER_READ_TIMEOUT, landing_views, split_requests
from shufflefs.client.replicas import InFlight, Placed
from shufflefs.rpc import framing
from shufflefs.rpc.blocking import CHANNEL_CALL_ID, open_frames
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.frame_socket import FrameSocket

log = logging.getLogger("shufflefs.client.channel_reads")

TICK = 0.1  # s: how often an idle reply thread checks its deadlines
RECONNECT_AFTER = 1.0  # s before a node whose connection failed is tried again
CONNECT_TIMEOUT = 3.0


class ChannelRead:
    """One read in flight: where its bytes go, its requests still out, the
    replicas that failed it, and what to call when it is over."""

    __slots__ = ("done", "failures", "out", "remaining", "started")

    def __init__(self, out: memoryview, done: Callable[[ChannelRead], None]) -> None:
        self.out = out
        self.done = done
        self.remaining = 0
        self.failures: list[tuple[int, int]] = []  # (target id, errno)
        self.started = time.perf_counter()

    @property
    def ok(self) -> bool:
        return not self.failures


class _Request:
    __slots__ = ("deadline", "items", "read")

    def __init__(self, read: ChannelRead, items: list[Placed], deadline: float) -> None:
        self.read = read
        self.items = items
        self.deadline = deadline


class NodeChannel:
    """The connection to one storage node and its reply thread."""

    def __init__(self, owner: ReadChannels, address: str) -> None:
        self.owner = owner
        self.address = address
        self.lock = threading.Lock()  # pending and broken, against `fail`
        self.pending: dict[int, _Request] = {}
        self.outbox: list[bytes] = []  # queued request frames (event loop's thread)
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

    def queue(self, request: _Request) -> bool:
        """Queue one read request for the next `flush` (event loop's
        thread); False if this connection is broken."""
        call_id = self.next_id
        self.next_id += 1
        body = framing.request_body(
            call_id, "read", {"items": [[tid, p[1], p[2], p[3]] for p, tid in request.items]}
        )
        with self.lock:
            if self.broken or self.frames is None:
                return False
            self.pending[call_id] = request
        self.outbox.append(framing.pack_header(len(body), 0) + body)
        self.queued.append(call_id)
        return True

    def flush(self) -> None:
        """Send the queued requests in one go, without waiting (event loop's
        thread). If the socket takes none of them (its buffer is full: the
        node is not reading) they fail and are read another way; if it takes
        part of one, the stream is out of sync and the connection is closed."""
        frames = self.frames
        frames_out, self.outbox = self.outbox, []
        queued, self.queued = self.queued, []
        if not frames_out or frames is None:
            return
        size = sum(len(f) for f in frames_out)
        try:
            sent = frames.sock.sendmsg(frames_out, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.fail(f"send failed: {exc}")
            return
        if sent == size:
            return
        if sent:  # a half-sent frame
            self.fail("send would have waited mid-frame")
            return
        with self.lock:
            unsent = [r for r in (self.pending.pop(i, None) for i in queued) if r is not None]
        for request in unsent:
            self.owner.failed(request, errno.EAGAIN)

    def _place(self, body: dict[Any, Any], size: int) -> Sequence[memoryview] | None:
        request = self.pending.get(body.get("i"))  # type: ignore[arg-type]
        result = body.get("r")
        if request is None or "e" in body or not isinstance(result, dict):
            return None
        lengths = result.get("lengths")
        if not isinstance(lengths, list):
            return None
        return landing_views(request.items, lengths, size, request.read.out)

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
                    self.owner.answered(request, body, payload, placed)
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
        come, are dropped): the reads fail over to another replica."""
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

    *outstanding*: the replica bookkeeping's requests in flight per target
    (`Replicas.outstanding`), counted here too so the replica choice sees
    these reads."""

    def __init__(
        self,
        secret: bytes,
        outstanding: InFlight,
        *,
        timeout: float = FAILOVER_READ_TIMEOUT,
    ) -> None:
        self.secret = secret
        self.outstanding = outstanding
        self.timeout = timeout
        self.lock = threading.Lock()
        self.channels: dict[str, NodeChannel] = {}
        self._connecting: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self.closed = False
        self.dirty: set[NodeChannel] = set()  # channels with queued requests
        self.sent = 0  # reads submitted (for tests and stats)
        self.failed_reads = 0

    def ready(self, addresses: Sequence[str]) -> bool:
        """Whether every one of *addresses* has a connection now; the ones
        that do not get one opened in the background."""
        missing = [a for a in addresses if a not in self.channels]
        for address in missing:
            self._connect_later(address)
        return not missing

    def submit(
        self,
        groups: dict[str, list[Placed]],
        out: memoryview,
        done: Callable[[ChannelRead], None],
    ) -> ChannelRead | None:
        """Queue a read (its pieces grouped per node, as `Replicas.assign`
        does) for the next `flush`; *done* is called once, from a reply
        thread (or the event loop's, if it fails to go out). None: not
        queued (a node has no connection yet): read it another way."""
        if self.closed or not self.ready(list(groups)):
            return None
        requests = [
            (self.channels[address], request)
            for address, items in groups.items()
            for request in (split_requests(items) if len(items) > 1 else [items])
        ]
        read = ChannelRead(out, done)
        read.remaining = len(requests)
        deadline = time.monotonic() + self.timeout
        for i, (channel, items) in enumerate(requests):
            request = _Request(read, items, deadline)
            for _, tid in items:
                self.outstanding.add(tid, 1)
            if channel.queue(request):
                self.dirty.add(channel)
                continue
            for _, tid in items:
                self.outstanding.add(tid, -1)
            if i == 0:  # nothing queued: the caller reads it another way
                return None
            for _, rest in requests[i:]:  # this one and those after it: failed
                for _, tid in rest:
                    self.outstanding.add(tid, 1)
                self.failed(_Request(read, rest, deadline), errno.EAGAIN)
            break
        self.sent += 1
        return read

    def flush(self) -> None:
        """Send every queued request (event loop's thread)."""
        dirty, self.dirty = self.dirty, set()
        for channel in dirty:
            channel.flush()

    def answered(
        self, request: _Request, body: dict[Any, Any], payload: bytearray | None, placed: bool
    ) -> None:
        """A reply is in (reply thread): its bytes into place unless they
        were received there, its failed items noted."""
        read = request.read
        if "e" in body:
            error = FsError.from_wire(body["e"])
            self._finish(request, [(tid, error.code) for _, tid in request.items])
            return
        result = body.get("r")
        lengths = result.get("lengths") if isinstance(result, dict) else None
        if not isinstance(lengths, list) or len(lengths) != len(request.items):
            self._finish(request, [(tid, errno.EPROTO) for _, tid in request.items])
            return
        failures = [(tid, -n) for (_, tid), n in zip(request.items, lengths, strict=True) if n < 0]
        if not placed and not failures:
            views = landing_views(request.items, lengths, len(payload or b""), read.out)
            if views is None:
                failures = [(tid, errno.EPROTO) for _, tid in request.items]
            else:
                src = memoryview(payload or b"")
                pos = 0
                for view in views:
                    view[:] = src[pos : pos + len(view)]
                    pos += len(view)
        self._finish(request, failures)

    def failed(self, request: _Request, code: int) -> None:
        self._finish(request, [(tid, code) for _, tid in request.items])

    def _finish(self, request: _Request, failures: list[tuple[int, int]]) -> None:
        read = request.read
        for _, tid in request.items:
            self.outstanding.add(tid, -1)
        with self.lock:
            read.failures.extend(failures)
            read.remaining -= 1
            last = read.remaining == 0
        if last:
            if read.failures:
                self.failed_reads += 1
            read.done(read)

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
        if channel.broken:
            channel.fail("closing")
            return
        self.channels[address] = channel

    def forget(self, channel: NodeChannel) -> None:
        with self.lock:
            if self.channels.get(channel.address) is channel:
                del self.channels[channel.address]
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
