"""Frames over one TCP socket: buffered receive, zero-copy bulk payloads.

Small frames are parsed out of one receive buffer, so a single ``recv`` can
deliver many replies; bulk payloads are received straight into a caller-owned
``bytearray`` with ``recv_into`` and sent with ``sendmsg`` from the caller's
buffers, so bulk bytes are copied by the kernel only.

The socket is a plain non-blocking stdlib socket driven with trio's readiness
waits (``wait_readable``/``wait_writable``) rather than ``trio.socket``: an
operation that can complete at once (a send into a socket buffer with room,
a receive of bytes already there) completes without a trip through the
scheduler, which is most of the cost of a small RPC. A frame is sent with
one ``sendmsg`` when it fits, which is almost always; only a partial send
takes the send lock and waits, so frames never interleave.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from typing import Any

import trio

from shufflefs.rpc import framing
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.heap import uninitialized

Buffer = bytes | bytearray | memoryview

RECV_BUFFER = 256 * 1024
MAX_IOV = 512


class ConnectionClosed(FsError):
    """The peer went away (EOF, reset, or we closed after a protocol error)."""

    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(errno.ECONNRESET, message)


def as_parts(payload: Buffer | Sequence[Buffer] | None) -> list[memoryview]:
    """A frame's payload as the memoryviews one ``sendmsg`` takes (empty ones dropped)."""
    if payload is None:
        return []
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return [memoryview(payload)] if len(payload) else []
    return [p if p.__class__ is memoryview else memoryview(p) for p in payload if len(p)]


def trim_sent(bufs: list[memoryview], first: int, sent: int) -> int:
    """*sent* more bytes of *bufs* went out from buffer *first* on: the index
    of the first buffer not yet sent whole (a partly sent one is trimmed)."""
    while sent:
        head = bufs[first]
        if sent >= head.nbytes:
            sent -= head.nbytes
            first += 1
        else:
            bufs[first] = head[sent:]
            sent = 0
    return first


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def raw_socket(sock: trio.socket.SocketType) -> socket.socket:
    """Take the OS socket out of a trio socket (which gives it up)."""
    raw = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    raw.setblocking(False)
    tune_socket(raw)
    return raw


class FrameStream:
    """One socket carrying frames. One reader task at a time; senders may be many."""

    def __init__(self, sock: socket.socket, limits: framing.Limits) -> None:
        self.sock = sock
        self.limits = limits
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._send_lock = trio.Lock()
        self.closed = False

    # ---- receive ---------------------------------------------------------

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            if self.closed:
                raise ConnectionClosed("connection closed")
            try:
                got = self.sock.recv_into(view)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self.sock)
                except (trio.ClosedResourceError, OSError) as exc:
                    raise ConnectionClosed(f"receive failed: {exc!r}") from None
                continue
            except OSError as exc:
                raise ConnectionClosed(f"receive failed: {exc!r}") from None
            if got == 0:
                raise ConnectionClosed("peer closed the connection")
            return got

    async def _recv_some(self) -> None:
        """Receive more bytes into the buffer (compacting it first if needed)."""
        if self._end == len(self._buf):
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        self._end += await self._recv_into(self._view[self._end :])

    async def receive_exactly(self, n: int) -> bytes:
        if n > len(self._buf):
            out = uninitialized(n)
            await self.receive_into(memoryview(out))
            return bytes(out)
        while self._end - self._start < n:
            if self._start + n > len(self._buf):
                m = self._end - self._start
                self._view[:m] = self._view[self._start : self._end]
                self._start, self._end = 0, m
            await self._recv_some()
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    async def receive_into(self, dest: memoryview) -> None:
        """Fill *dest* completely: first from the buffer, then straight from the socket."""
        have = min(self._end - self._start, len(dest))
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        pos = have
        total = len(dest)
        while pos < total:
            pos += await self._recv_into(dest[pos:])

    async def receive_frame(self) -> tuple[dict[Any, Any], bytearray | None]:
        """Wait for the next frame. Raises FsError for a bad header (the
        connection must then be closed: the stream is out of sync) and
        returns the decoded body (raising EBADMSG for malformed msgpack,
        after which the stream is still in sync)."""
        if self._end - self._start >= framing.HEADER_SIZE:  # already here: no scheduler trip
            header = bytes(self._view[self._start : self._start + framing.HEADER_SIZE])
            self._start += framing.HEADER_SIZE
        else:
            header = await self.receive_exactly(framing.HEADER_SIZE)
        body_len, payload_len = framing.unpack_header(header, self.limits)
        available = self._end - self._start
        if available >= body_len + payload_len:  # all buffered (a small frame): no timeout
            body = self._view[self._start : self._start + body_len]
            self._start += body_len
            buffered: bytearray | None = None
            if payload_len:
                buffered = bytearray(self._view[self._start : self._start + payload_len])
                self._start += payload_len
            return framing.unpack_body(body), buffered
        with trio.move_on_after(self.limits.frame_timeout) as scope:
            data = await self.receive_exactly(body_len)
            payload: bytearray | None = None
            if payload_len:
                payload = uninitialized(payload_len)
                await self.receive_into(memoryview(payload))
        if scope.cancelled_caught:
            raise ConnectionClosed("frame not completed within the frame timeout")
        return framing.unpack_body(data), payload

    # ---- send ------------------------------------------------------------

    def _check_limits(self, body: bytes, payload_len: int) -> None:
        if len(body) > self.limits.max_body:
            raise FsError(errno.EMSGSIZE, f"frame body {len(body)} > limit {self.limits.max_body}")
        if payload_len > self.limits.max_payload:
            raise FsError(
                errno.EMSGSIZE, f"frame payload {payload_len} > limit {self.limits.max_payload}"
            )

    def send_would_wait(self) -> bool:
        """Whether `send_frame` would wait for another sender before trying."""
        return self._send_lock.locked()

    async def send_frame(
        self, body: bytes, payload: Buffer | Sequence[Buffer] | None = None
    ) -> None:
        """Send one frame. If the socket takes it whole at once (the usual
        case) this never yields. Otherwise the rest is sent under the send
        lock, shielded from cancellation (a half-sent frame would desynchronize
        the stream) but bounded by the send timeout, after which the
        connection is closed."""
        parts = as_parts(payload)
        payload_len = sum(p.nbytes for p in parts)
        self._check_limits(body, payload_len)
        if self.closed:
            raise ConnectionClosed("connection already closed")
        bufs = [memoryview(framing.pack_header(len(body), payload_len) + body), *parts]
        if not self._send_lock.locked():
            first = self._send_nowait(bufs, 0)
            if first == len(bufs):
                return
            self._send_lock.acquire_nowait()  # no yield since the check: it is free
        else:
            await self._send_lock.acquire()
            first = 0
        try:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.limits.send_timeout) as scope:
                    await self._send_rest(bufs, first)
                if scope.cancelled_caught:
                    self.close()
                    raise ConnectionClosed("send timed out; connection closed")
        finally:
            self._send_lock.release()

    def _send_nowait(self, bufs: list[memoryview], first: int) -> int:
        """Send what the socket takes now; returns the index of the first
        buffer not yet sent completely (partly sent buffers are trimmed)."""
        while first < len(bufs):
            try:
                sent = self.sock.sendmsg(bufs[first : first + MAX_IOV])
            except BlockingIOError:
                return first
            except OSError as exc:
                self.close()
                raise ConnectionClosed(f"send failed: {exc}") from None
            first = trim_sent(bufs, first, sent)
        return first

    async def _send_rest(self, bufs: list[memoryview], first: int) -> None:
        while first < len(bufs):
            if self.closed:
                raise ConnectionClosed("connection closed while sending")
            try:
                await trio.lowlevel.wait_writable(self.sock)
            except (trio.ClosedResourceError, OSError) as exc:
                raise ConnectionClosed(f"send failed: {exc!r}") from None
            first = self._send_nowait(bufs, first)

    async def send_raw(self, data: bytes) -> None:
        """Send unframed bytes (the auth handshake only)."""
        async with self._send_lock:
            bufs = [memoryview(data)]
            await self._send_rest(bufs, self._send_nowait(bufs, 0))

    def detach(self) -> tuple[socket.socket, bytes]:
        """Give the socket up (blocking again, off the loop) with the bytes
        received past the last frame; this stream is closed without closing
        it. Only when no task is using the stream."""
        leftover = bytes(self._view[self._start : self._end])
        self.closed = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.setblocking(True)
        return self.sock, leftover

    def close(self) -> None:
        """Close now; tasks waiting on the socket wake up with ConnectionClosed."""
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()
