"""A blocking RPC client: the same frames and handshake over a plain socket.

The native client runs its async core on a trio loop in a background thread;
handing every call to that thread and back costs two thread switches, which
is most of the latency of a small read. Hot, idempotent calls (reads) can
instead be made from the caller's own thread over a connection that thread
owns: send the request, block on the reply. No scheduler, no thread hop.

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
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer, ConnectionClosed

# (result, payload length) -> the buffers the payload fills in order, or None
PayloadPlacer = Callable[[Any, int], Sequence[memoryview] | None]


class BlockingConnection:
    """One connection, used by one thread at a time."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        timeout: float,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
    ) -> None:
        self.address = address
        self.limits = limits
        self.timeout = timeout
        host, port = parse_address(address)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            code = errno.ETIMEDOUT if isinstance(exc, TimeoutError) else exc.errno
            raise FsError(
                code or errno.ECONNREFUSED, f"cannot connect to {address}: {exc}"
            ) from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ids = itertools.count(1)
        try:
            self._handshake(secret)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, secret: bytes) -> None:
        hello = self._recv_exactly(len(GREETING) + NONCE)
        if hello[: len(GREETING)] != GREETING:
            raise FsError(errno.EPROTO, f"{self.address} is not a shufflefs server")
        server_nonce = hello[len(GREETING) :]
        client_nonce = secrets.token_bytes(NONCE)
        self._send(
            [memoryview(client_nonce + proof(secret, b"client", server_nonce, client_nonce))]
        )
        answer = self._recv_exactly(2 + MAC)
        if answer[:2] != b"OK" or not hmac.compare_digest(
            answer[2:], proof(secret, b"server", client_nonce, server_nonce)
        ):
            raise FsError(errno.EACCES, f"{self.address} failed authentication")

    def _send(self, bufs: list[memoryview]) -> None:
        try:
            while bufs:
                sent = self.sock.sendmsg(bufs)
                while sent:
                    if sent >= bufs[0].nbytes:
                        sent -= bufs[0].nbytes
                        bufs.pop(0)
                    else:
                        bufs[0] = bufs[0][sent:]
                        sent = 0
        except TimeoutError:
            raise FsError(errno.ETIMEDOUT, f"sending to {self.address} timed out") from None
        except OSError as exc:
            raise ConnectionClosed(f"send to {self.address} failed: {exc}") from None

    def _recv_into(self, view: memoryview) -> None:
        pos = 0
        try:
            while pos < len(view):
                got = self.sock.recv_into(view[pos:])
                if not got:
                    raise ConnectionClosed(f"{self.address} closed the connection")
                pos += got
        except TimeoutError:
            raise FsError(errno.ETIMEDOUT, f"reply from {self.address} timed out") from None
        except OSError as exc:
            raise ConnectionClosed(f"receive from {self.address} failed: {exc}") from None

    def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def send_request(
        self, method: str, args: dict[str, Any], payload: Buffer | Sequence[Buffer] | None = None
    ) -> int:
        call_id = next(self._ids)
        body = framing.request_body(call_id, method, args)
        parts = (
            []
            if payload is None
            else [memoryview(payload)]
            if isinstance(payload, (bytes, bytearray, memoryview))
            else [memoryview(p) for p in payload]
        )
        size = sum(p.nbytes for p in parts)
        self._send([memoryview(framing.pack_header(len(body), size) + body), *parts])
        return call_id

    def receive_reply(
        self, call_id: int, place: PayloadPlacer | None = None
    ) -> tuple[Any, bytearray | None]:
        """The reply to *call_id* (requests on one connection are answered
        in order here: this connection has at most one request in flight
        per `call`, or several sent back to back and received in turn).
        With *place*, a result's payload is received straight into the
        buffers ``place(result, payload_len)`` names (they must add up to
        it; None: into a new bytearray as usual) and None is returned for it."""
        header = self._recv_exactly(framing.HEADER_SIZE)
        body_len, payload_len = framing.unpack_header(header, self.limits)
        body = framing.unpack_body(self._recv_exactly(body_len))
        payload = None
        if payload_len:
            views = None
            if place is not None and body.get("i") == call_id and "e" not in body:
                views = place(body.get("r"), payload_len)
            if views is None:
                payload = bytearray(payload_len)
                self._recv_into(memoryview(payload))
            else:
                for view in views:
                    self._recv_into(view)
        if body.get("i") != call_id:
            raise ConnectionClosed(f"{self.address}: reply for call {body.get('i')}, not {call_id}")
        if "e" in body:
            raise FsError.from_wire(body["e"])
        return body.get("r"), payload

    def close(self) -> None:
        self.sock.close()


class BlockingPeers:
    """Blocking connections by peer address, one set per thread."""

    def __init__(self, secret: bytes, timeout: float = 5.0) -> None:
        self.secret = secret
        self.timeout = timeout
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
            conn = conns[address] = BlockingConnection(address, self.secret, self.timeout)
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
