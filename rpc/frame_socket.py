"""Frames over a blocking socket, for code that runs on a thread of its own
rather than on the trio loop: the blocking client (`rpc/blocking.py`) and
the thread channels of a server (`rpc/channel.py`).

The same frames as `transport.FrameStream`, received through one buffer (a
small frame costs one ``recv``: header and body together) with bulk
payloads received straight into a caller's buffers, and sent with one
``sendmsg`` of the header, body and payload buffers.

The socket's timeout bounds each send and each receive once a frame has
begun; an idle connection may wait for its next header as long as it likes
(``idle=True``). Errors are FsError: ETIMEDOUT for a timeout,
`ConnectionClosed` for anything that leaves the stream unusable.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from shufflefs.rpc import framing
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.heap import uninitialized
from shufflefs.rpc.transport import MAX_IOV, ConnectionClosed, trim_sent

RECV_BUFFER = 64 * 1024

# (reply body, payload length) -> the buffers the payload fills in order, or None
PayloadPlacer = Callable[[dict[Any, Any], int], Sequence[memoryview] | None]


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make *sock* blocking with its timeouts kept by the kernel
    (SO_RCVTIMEO, SO_SNDTIMEO: a receive or send that waits that long fails
    with EAGAIN). Python's own socket timeout would poll() before every
    receive and send: two more system calls per request."""
    sock.settimeout(None)
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class FrameSocket:
    """One blocking socket carrying frames: one receiving thread at a time;
    senders must not interleave (the caller holds a lock if there are several).

    *timeout* bounds every send and every frame once begun. The kernel wakes
    a waiting thread every *tick* (default: *timeout*; `kernel_timeouts`):
    while waiting for a frame's first byte with ``idle=True`` it calls
    *on_idle* then (a reply thread checks its deadlines) and waits on."""

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        limits: framing.Limits,
        timeout: float,
        leftover: bytes = b"",
        *,
        tick: float | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.tick = min(tick or timeout, timeout)
        self.on_idle = on_idle
        kernel_timeouts(sock, self.tick)
        self.sock = sock
        self.peer = peer
        self.limits = limits
        self._buf = bytearray(max(RECV_BUFFER, len(leftover)))
        self._view = memoryview(self._buf)
        self._buf[: len(leftover)] = leftover
        self._start = 0
        self._end = len(leftover)

    # ---- send ------------------------------------------------------------

    def send(self, bufs: list[memoryview]) -> None:
        """Send every byte of *bufs* (trimmed in place as they go)."""
        first = 0
        waited = 0.0
        try:
            while first < len(bufs):
                try:
                    sent = self.sock.sendmsg(bufs[first : first + MAX_IOV])
                except (TimeoutError, BlockingIOError):
                    waited += self.tick
                    if waited >= self.timeout:
                        raise
                    continue
                first = trim_sent(bufs, first, sent)
        except (TimeoutError, BlockingIOError):
            raise FsError(errno.ETIMEDOUT, f"sending to {self.peer} timed out") from None
        except OSError as exc:
            raise ConnectionClosed(f"send to {self.peer} failed: {exc}") from None

    def send_frame(self, body: bytes, payload: Sequence[memoryview] = ()) -> None:
        size = sum(p.nbytes for p in payload)
        self.send([memoryview(framing.pack_header(len(body), size) + body), *payload])

    # ---- receive ---------------------------------------------------------

    def _recv(self, view: memoryview, idle: bool = False) -> int:
        return self._received(self.sock.recv_into, view, idle)

    def _received(self, receive: Callable[[Any], int], into: Any, idle: bool = False) -> int:
        """``receive(into)``, waited for within the timeout (*idle*: for ever,
        calling `on_idle` every tick): the bytes received, never 0."""
        waited = 0.0
        while True:
            try:
                got = receive(into)
            except (TimeoutError, BlockingIOError):
                if idle:
                    if self.on_idle is not None:
                        self.on_idle()
                    continue
                waited += self.tick
                if waited < self.timeout:
                    continue
                raise FsError(errno.ETIMEDOUT, f"reply from {self.peer} timed out") from None
            except OSError as exc:
                raise ConnectionClosed(f"receive from {self.peer} failed: {exc}") from None
            if not got:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            return got

    def _recvmsg_into(self, bufs: list[memoryview]) -> int:
        got: int = self.sock.recvmsg_into(bufs)[0]
        return got

    def _fill(self, n: int, idle: bool = False) -> None:
        """At least *n* bytes in the buffer (n <= its size)."""
        if self._start + n > len(self._buf):
            have = self._end - self._start
            self._view[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            self._end += self._recv(self._view[self._end :], idle and self._end == self._start)

    def frame_buffered(self) -> bool:
        """Whether a whole frame is already in the receive buffer (the next
        `receive_frame` will not wait)."""
        have = self._end - self._start
        if have < framing.HEADER_SIZE:
            return False
        _, _, body_len, payload_len = framing.HEADER.unpack_from(self._buf, self._start)
        return have >= framing.HEADER_SIZE + body_len + payload_len

    def recv_into(self, dest: memoryview) -> None:
        """Fill *dest*: first from the buffer, then straight from the socket."""
        have = min(self._end - self._start, len(dest))
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        pos = have
        while pos < len(dest):
            pos += self._recv(dest[pos:])

    def recv_into_all(self, views: Sequence[memoryview]) -> None:
        """Fill *views* in order: first from the buffer, then straight from
        the socket, many views per receive (``recvmsg_into``)."""
        bufs = [v for v in views if v.nbytes]
        first = 0
        while first < len(bufs) and self._start < self._end:
            head = bufs[first]
            have = min(self._end - self._start, head.nbytes)
            head[:have] = self._view[self._start : self._start + have]
            self._start += have
            first = trim_sent(bufs, first, have)
        while first < len(bufs):
            got = self._received(self._recvmsg_into, bufs[first : first + MAX_IOV])
            first = trim_sent(bufs, first, got)

    def recv_exactly(self, n: int) -> bytes:
        if n > len(self._buf):
            out = uninitialized(n)
            self.recv_into(memoryview(out))
            return bytes(out)
        self._fill(n)
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def receive_frame(
        self, place: PayloadPlacer | None = None, idle: bool = False
    ) -> tuple[dict[Any, Any], bytearray | None, bool]:
        """The next frame: (body, payload, placed). With *place*, the payload
        goes straight into the buffers ``place(body, payload_len)`` names
        (they must add up to it; None: a new bytearray as usual) and placed
        is True. *idle*: wait for the header's first byte without a timeout.
        A bad header raises (the stream is out of sync: close it); a
        malformed body raises EBADMSG once the whole frame was consumed."""
        self._fill(framing.HEADER_SIZE, idle)
        header = self._view[self._start : self._start + framing.HEADER_SIZE]
        body_len, payload_len = framing.unpack_header(header, self.limits)
        self._start += framing.HEADER_SIZE
        if body_len <= len(self._buf):
            self._fill(body_len)
            raw = self._view[self._start : self._start + body_len]
            self._start += body_len
        else:
            raw = memoryview(self.recv_exactly(body_len))
        try:
            body = framing.unpack_body(raw)
        except FsError:
            self._skip(payload_len)
            raise
        if not payload_len:
            return body, None, False
        views = place(body, payload_len) if place is not None else None
        if views is None:
            payload = uninitialized(payload_len)
            self.recv_into(memoryview(payload))
            return body, payload, False
        self.recv_into_all(views)
        return body, None, True

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, RECV_BUFFER)))
        while n:
            step = min(n, len(scratch))
            self.recv_into(scratch[:step])
            n -= step

    def shutdown(self) -> None:
        """Wake a thread blocked receiving on this socket (it sees EOF)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.sock.close()
