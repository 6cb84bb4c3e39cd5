"""Frames over one TCP socket: buffered receive, zero-copy bulk payloads.

Small frames are parsed out of one receive buffer, so a single ``recv`` can
deliver many replies; bulk payloads are received straight into a caller-owned
``bytearray`` with ``recv_into`` and sent with ``sendmsg`` from the caller's
buffers, so bulk bytes are copied by the kernel only.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from typing import Any

import trio

from shufflefs.rpc import framing
from shufflefs.rpc.errors import FsError

Buffer = bytes | bytearray | memoryview

RECV_BUFFER = 256 * 1024


class ConnectionClosed(FsError):
    """The peer went away (EOF, reset, or we closed after a protocol error)."""

    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(errno.ECONNRESET, message)


def tune_socket(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class FrameStream:
    """One socket carrying frames. One reader task at a time; senders are
    serialized by an internal lock so a frame is never interleaved."""

    def __init__(self, sock: trio.socket.SocketType, limits: framing.Limits) -> None:
        self.sock = sock
        self.limits = limits
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._send_lock = trio.Lock()
        self.closed = False

    # ---- receive ---------------------------------------------------------

    async def _recv_some(self) -> None:
        """Receive more bytes into the buffer (compacting it first if needed)."""
        if self._end == len(self._buf):
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        try:
            got = await self.sock.recv_into(self._view[self._end :])
        except (OSError, trio.ClosedResourceError) as exc:
            raise ConnectionClosed(f"receive failed: {exc!r}") from None
        if got == 0:
            raise ConnectionClosed("peer closed the connection")
        self._end += got

    async def receive_exactly(self, n: int) -> bytes:
        if n > len(self._buf):
            out = bytearray(n)
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
            try:
                got = await self.sock.recv_into(dest[pos:])
            except (OSError, trio.ClosedResourceError) as exc:
                raise ConnectionClosed(f"receive failed: {exc!r}") from None
            if got == 0:
                raise ConnectionClosed("peer closed the connection mid-frame")
            pos += got

    async def receive_frame(self) -> tuple[dict[Any, Any], bytearray | None]:
        """Wait for the next frame. Raises FsError for a bad header (the
        connection must then be closed: the stream is out of sync) and
        returns the decoded body (raising EBADMSG for malformed msgpack,
        after which the stream is still in sync)."""
        header = await self.receive_exactly(framing.HEADER_SIZE)
        body_len, payload_len = framing.unpack_header(header, self.limits)
        with trio.move_on_after(self.limits.frame_timeout) as scope:
            body = await self.receive_exactly(body_len)
            payload: bytearray | None = None
            if payload_len:
                payload = bytearray(payload_len)
                await self.receive_into(memoryview(payload))
        if scope.cancelled_caught:
            raise ConnectionClosed("frame not completed within the frame timeout")
        return framing.unpack_body(body), payload

    # ---- send ------------------------------------------------------------

    async def send_frame(
        self, body: bytes, payload: Buffer | Sequence[Buffer] | None = None
    ) -> None:
        """Send one frame. Shielded from cancellation (a half-sent frame would
        desynchronize the stream) but bounded by the send timeout, after which
        the connection is closed."""
        parts: list[memoryview]
        if payload is None:
            parts = []
        elif isinstance(payload, (bytes, bytearray, memoryview)):
            parts = [memoryview(payload)] if len(payload) else []
        else:
            parts = [memoryview(p) for p in payload if len(p)]
        payload_len = sum(p.nbytes for p in parts)
        if len(body) > self.limits.max_body:
            raise FsError(errno.EMSGSIZE, f"frame body {len(body)} > limit {self.limits.max_body}")
        if payload_len > self.limits.max_payload:
            raise FsError(
                errno.EMSGSIZE, f"frame payload {payload_len} > limit {self.limits.max_payload}"
            )
        head = framing.pack_header(len(body), payload_len) + body
        bufs = [memoryview(head), *parts]
        with trio.CancelScope(shield=True):
            async with self._send_lock:
                if self.closed:
                    raise ConnectionClosed("connection already closed")
                with trio.move_on_after(self.limits.send_timeout) as scope:
                    await self._send_all(bufs)
                if scope.cancelled_caught:
                    await self.aclose()
                    raise ConnectionClosed("send timed out; connection closed")

    async def send_raw(self, data: bytes) -> None:
        """Send unframed bytes (the auth handshake only)."""
        async with self._send_lock:
            await self._send_all([memoryview(data)])

    async def _send_all(self, bufs: list[memoryview]) -> None:
        try:
            first = 0
            while first < len(bufs):
                sent = await self.sock.sendmsg(bufs[first : first + 512])
                while sent:
                    head = bufs[first]
                    if sent >= head.nbytes:
                        sent -= head.nbytes
                        first += 1
                    else:
                        bufs[first] = head[sent:]
                        sent = 0
        except (OSError, trio.ClosedResourceError) as exc:
            self.closed = True
            self.sock.close()
            raise ConnectionClosed(f"send failed: {exc}") from None

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
        await trio.lowlevel.checkpoint()
