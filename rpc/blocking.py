"""A blocking RPC client: the same frames and handshake over a plain socket.

The native client runs its async core on a trio loop in a background thread;
handing every call to that thread and back costs two thread switches, which
is most of the latency of a small read. Hot, idempotent calls (reads) can
instead be made from the caller's own thread over a connection that thread
owns: send the request, block on the reply. No scheduler, no thread hop.

With ``channel=True`` the connection asks the server to serve it on a
thread channel (`rpc/channel.py`: no event loop on the server's side
either); a server without channels answers ENOSYS and the connection goes
on as an ordinary one. Replies may come back in any order (a channel
answers page-cache reads before disk reads); `receive_reply` keeps the ones
that are not yet asked for.

A `BlockingPeers` holds one connection per peer per thread. Errors are
FsError, as everywhere; the caller decides whether to retry elsewhere.
"""

from __future__ import annotations

import errno
import hmac
import itertools
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shufflefs.rpc import framing
from shufflefs.rpc.addresses import parse_address
from shufflefs.rpc.auth import GREETING, MAC, NONCE, proof
from shufflefs.rpc.channel import CHANNEL_METHOD
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.frame_socket import FrameSocket
from shufflefs.rpc.transport import Buffer, ConnectionClosed, as_parts

# (result, payload length) -> the buffers the payload fills in order, or None
PayloadPlacer = Callable[[Any, int], Sequence[memoryview] | None]


def connect_socket(address: str, timeout: float) -> socket.socket:
    """A connected TCP socket with *timeout*, or FsError."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        code = errno.ETIMEDOUT if isinstance(exc, TimeoutError) else exc.errno
        raise FsError(code or errno.ECONNREFUSED, f"cannot connect to {address}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def client_handshake(frames: FrameSocket, secret: bytes) -> None:
    """`auth.client_handshake` over a blocking socket."""
    hello = frames.recv_exactly(len(GREETING) + NONCE)
    if hello[: len(GREETING)] != GREETING:
        raise FsError(errno.EPROTO, f"{frames.peer} is not a shufflefs server")
    server_nonce = hello[len(GREETING) :]
    client_nonce = secrets.token_bytes(NONCE)
    frames.send([memoryview(client_nonce + proof(secret, b"client", server_nonce, client_nonce))])
    answer = frames.recv_exactly(2 + MAC)
    if answer[:2] != b"OK" or not hmac.compare_digest(
        answer[2:], proof(secret, b"server", client_nonce, server_nonce)
    ):
        raise FsError(errno.EACCES, f"{frames.peer} failed authentication")


def open_channel(frames: FrameSocket, call_id: int) -> bool:
    """Ask the server to serve this connection on a thread channel; False if
    it has none (the connection stays an ordinary one)."""
    frames.send_frame(framing.request_body(call_id, CHANNEL_METHOD, {}))
    body, _, _ = frames.receive_frame()
    if body.get("i") != call_id:
        raise ConnectionClosed(f"{frames.peer}: reply for call {body.get('i')}, not {call_id}")
    if "e" in body:
        error = FsError.from_wire(body["e"])
        if error.code == errno.ENOSYS:
            return False
        raise error
    return True


def open_frames(
    address: str,
    secret: bytes,
    timeout: float,
    *,
    channel: bool,
    limits: framing.Limits = framing.DEFAULT_LIMITS,
    tick: float | None = None,
    on_idle: Callable[[], None] | None = None,
) -> tuple[FrameSocket, bool]:
    """An authenticated blocking connection to *address* (see `FrameSocket`
    for *tick* and *on_idle*), and whether it became a thread channel (asked
    for with *channel*)."""
    frames = FrameSocket(
        connect_socket(address, timeout), address, limits, timeout, tick=tick, on_idle=on_idle
    )
    try:
        client_handshake(frames, secret)
        return frames, channel and open_channel(frames, CHANNEL_CALL_ID)
    except BaseException:
        frames.close()
        raise


CHANNEL_CALL_ID = 1  # the id of the channel request: the first call on a connection


class BlockingConnection:
    """One connection, used by one thread at a time."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        timeout: float,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
        channel: bool = False,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.frames, self.channel = open_frames(
            address, secret, timeout, channel=channel, limits=limits
        )
        self._ids = itertools.count(CHANNEL_CALL_ID + 1)
        self._last = 0  # the newest call id sent
        # replies that arrived before they were asked for (a channel answers
        # in completion order): call id -> body, payload
        self._early: dict[int, tuple[dict[Any, Any], bytearray | None]] = {}

    def send_request(
        self, method: str, args: dict[str, Any], payload: Buffer | Sequence[Buffer] | None = None
    ) -> int:
        call_id = self._last = next(self._ids)
        body = framing.request_body(call_id, method, args)
        self.frames.send_frame(body, as_parts(payload))
        return call_id

    def receive_reply(
        self, call_id: int, place: PayloadPlacer | None = None
    ) -> tuple[Any, bytearray | None]:
        """The reply to *call_id* (replies to other calls sent on this
        connection that arrive first are kept for their own turn). With
        *place*, a result's payload is received straight into the buffers
        ``place(result, payload_len)`` names (they must add up to it; None:
        into a new bytearray as usual) and None is returned for it."""
        early = self._early.pop(call_id, None)
        if early is not None:
            body, payload = early
        else:

            def placer(body: dict[Any, Any], size: int) -> Sequence[memoryview] | None:
                if place is None or body.get("i") != call_id or "e" in body:
                    return None
                return place(body.get("r"), size)

            while True:
                body, payload, _ = self.frames.receive_frame(placer)
                got = body.get("i")
                if got == call_id:
                    break
                if not isinstance(got, int) or not 0 < got <= self._last or len(self._early) > 4096:
                    raise ConnectionClosed(f"{self.address}: reply for unknown call {got!r}")
                self._early[got] = (body, payload)
        if "e" in body:
            raise FsError.from_wire(body["e"])
        return body.get("r"), payload

    def close(self) -> None:
        self.frames.close()


class BlockingPeers:
    """Blocking connections by peer address, one set per thread. With
    *channel*, each asks its server for a thread channel."""

    def __init__(self, secret: bytes, timeout: float = 5.0, channel: bool = False) -> None:
        self.secret = secret
        self.timeout = timeout
        self.channel = channel
        self._local = threading.local()

    def _conns(self) -> dict[str, BlockingConnection]:
        conns: dict[str, BlockingConnection] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def connection(self, address: str) -> BlockingConnection:
        conns = self._conns()
        conn = conns.get(address)
        if conn is None:
            conn = conns[address] = BlockingConnection(
                address, self.secret, self.timeout, channel=self.channel
            )
        return conn

    def drop(self, address: str) -> None:
        conn = self._conns().pop(address, None)
        if conn is not None:
            conn.close()

    def call(self, address: str, method: str, args: dict[str, Any]) -> tuple[Any, bytearray | None]:
        """One request and its reply. A broken connection is dropped (the
        next call reconnects) and the error raised."""
        conn = self.connection(address)
        try:
            return conn.receive_reply(conn.send_request(method, args))
        except FsError as exc:
            if exc.code in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPROTO, errno.EMSGSIZE):
                self.drop(address)
            raise
