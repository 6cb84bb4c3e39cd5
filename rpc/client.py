"""The RPC client: one persistent connection per peer, many calls in flight.

`RpcClient` owns a nursery (structured concurrency: it lives inside an
``async with open_rpc_client(...)``) in which each connection's reader task
runs. Calls to a peer share its connection; the first call connects (callers
racing to connect wait for the same attempt). A broken connection fails the
calls in flight on it with ECONNRESET and is replaced on the next call; which
calls are safe to retry is the caller's business (the client library knows).
Every call has a timeout: its deadline is noted with the call and enforced
by one sweeper task per client (`RpcClient._expire`, every `EXPIRY_TICK`),
not by a cancel scope per call (that costs ~10-30 us, a tenth of a remote
4 KiB read). While the sweeper is not running (not started yet, or its
nursery torn down, as in a Ctrl-C's cleanup) a call's own wait has the
deadline instead. A call waiting when the nursery is cancelled is failed by
its connection's reader, which dies with the sweeper.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from shufflefs.rpc import framing
from shufflefs.rpc.addresses import parse_address
from shufflefs.rpc.auth import client_handshake
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer, ConnectionClosed, FrameStream, raw_socket

log = logging.getLogger("shufflefs.rpc.client")

DEFAULT_CONNECT_TIMEOUT = 3.0
DEFAULT_CALL_TIMEOUT = 10.0
EXPIRY_TICK = 0.05  # seconds between sweeps for calls past their deadline


class _Pending:
    __slots__ = (
        "deadline",
        "done",
        "error",
        "method",
        "payload",
        "position",
        "result",
        "timeout",
    )

    def __init__(self, method: str, timeout: float, deadline: float) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.payload: bytearray | None = None
        self.position: int | None = None
        self.error: FsError | None = None
        self.method = method
        self.timeout = timeout
        self.deadline = deadline


@dataclass
class Response:
    result: Any
    payload: bytearray | None
    position: int | None = None  # the server's log position, if it keeps a log


class Sweeper:
    """Whether the client's deadline sweeper runs (shared by its connections)."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running = False


class PeerConnection:
    """One authenticated connection; calls are matched to replies by id."""

    def __init__(self, stream: FrameStream, address: str, sweeper: Sweeper | None = None) -> None:
        self.stream = stream
        self.address = address
        self.sweeper = sweeper or Sweeper()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.broken: FsError | None = None

    async def reader(self) -> None:
        try:
            while True:
                body, payload = await self.stream.receive_frame()
                call_id = body.get("i")
                waiter = self._pending.pop(call_id, None) if isinstance(call_id, int) else None
                if waiter is None:
                    if (
                        call_id == 0 and "e" in body
                    ):  # the server refused a frame it could not parse
                        raise FsError.from_wire(body["e"])
                    continue  # a reply whose caller timed out
                if "e" in body:
                    waiter.error = FsError.from_wire(body["e"])
                else:
                    waiter.result = body.get("r")
                    waiter.payload = payload
                    position = body.get("s")
                    if isinstance(position, int):
                        waiter.position = position
                waiter.done.set()
        except FsError as exc:
            self._fail_all(
                exc if isinstance(exc, ConnectionClosed) else ConnectionClosed(exc.message)
            )
        except BaseException:
            self._fail_all(ConnectionClosed("connection reader stopped"))
            raise
        finally:
            await self.close()

    def expire(self, now: float) -> None:
        """Fail the calls past their deadline with ETIMEDOUT."""
        late = [i for i, w in self._pending.items() if w.deadline <= now]
        for call_id in late:
            waiter = self._pending.pop(call_id)
            waiter.error = FsError(
                errno.ETIMEDOUT,
                f"{waiter.method} to {self.address} timed out after {waiter.timeout:g}s",
            )
            waiter.done.set()

    def _fail_all(self, error: FsError) -> None:
        self.broken = error
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.error = error
            waiter.done.set()

    async def close(self) -> None:
        if self.broken is None:
            self._fail_all(ConnectionClosed("connection closed"))
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    async def request(
        self,
        method: str,
        args: dict[str, Any],
        payload: Buffer | Sequence[Buffer] | None,
        timeout: float,
        after: int | None = None,
    ) -> Response:
        if self.broken is not None:
            raise self.broken
        call_id = next(self._ids)
        deadline = trio.current_time() + timeout
        waiter = _Pending(method, timeout, deadline)
        self._pending[call_id] = waiter
        try:
            body = framing.request_body(call_id, method, args, after)
            if self.stream.send_would_wait():  # another frame is being sent: bounded wait
                with trio.move_on_at(deadline) as scope:
                    await self.stream.send_frame(body, payload)
                if scope.cancelled_caught:
                    raise FsError(
                        errno.ETIMEDOUT, f"{method} to {self.address} timed out after {timeout:g}s"
                    )
            else:  # goes out at once (the rest of a partial send is bounded by the stream)
                await self.stream.send_frame(body, payload)
            # a reply, a broken connection, or `expire` (the module docstring)
            if self.sweeper.running:
                await waiter.done.wait()
            else:
                with trio.move_on_at(deadline):
                    await waiter.done.wait()
            if not waiter.done.is_set():
                raise FsError(
                    errno.ETIMEDOUT, f"{method} to {self.address} timed out after {timeout:g}s"
                )
        finally:
            self._pending.pop(call_id, None)
        error = waiter.error
        if error is not None:  # raise a fresh exception: the waiter's may be shared
            if isinstance(error, ConnectionClosed):
                raise ConnectionClosed(f"{method} to {self.address}: {error.message}")
            raise FsError(error.code, error.message)
        return Response(waiter.result, waiter.payload, waiter.position)


class RpcClient:
    """Calls to any number of peers, by address."""

    def __init__(
        self,
        secret: bytes,
        nursery: trio.Nursery,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
    ) -> None:
        self.secret = secret
        self.nursery = nursery
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.limits = limits
        self._conns: dict[str, PeerConnection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self.closed = False
        self._sweep_scope: trio.CancelScope | None = None
        self._sweeping = Sweeper()

    async def connection(self, address: str) -> PeerConnection:
        conn = self._conns.get(address)
        if conn is not None and conn.broken is None:
            return conn
        lock = self._connecting.setdefault(address, trio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is not None and conn.broken is None:
                return conn
            conn = await self._connect(address)
            self._conns[address] = conn
            self.nursery.start_soon(conn.reader, name=f"rpc-reader {address}")
            if self._sweep_scope is None:
                self._sweep_scope = trio.CancelScope()
                self.nursery.start_soon(self._expire, self._sweep_scope, name="rpc-call-deadlines")
            return conn

    async def _expire(self, scope: trio.CancelScope) -> None:
        """Fail calls past their deadline (see the module docstring)."""
        self._sweeping.running = True
        try:
            with scope:
                while True:
                    await trio.sleep(EXPIRY_TICK)
                    now = trio.current_time()
                    for conn in list(self._conns.values()):
                        conn.expire(now)
        finally:
            self._sweeping.running = False

    async def _connect(self, address: str) -> PeerConnection:
        if self.closed:
            raise FsError(errno.ESHUTDOWN, "rpc client is closed")
        host, port = parse_address(address)
        with trio.move_on_after(self.connect_timeout) as scope:
            try:
                infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, type_, proto, _, sockaddr = infos[0]
                sock = trio.socket.socket(family, type_, proto)
            except OSError as exc:
                raise FsError(errno.EHOSTUNREACH, f"cannot resolve {address}: {exc}") from None
            try:
                await sock.connect(sockaddr)
            except OSError as exc:
                sock.close()
                code = exc.errno or errno.ECONNREFUSED
                raise FsError(code, f"cannot connect to {address}: {exc.strerror or exc}") from None
            except BaseException:
                sock.close()
                raise
            stream = FrameStream(raw_socket(sock), self.limits)
            try:
                await client_handshake(stream, self.secret)
            except BaseException:
                stream.close()
                raise
        if scope.cancelled_caught:  # whatever was opened was closed on the way out
            raise FsError(errno.ETIMEDOUT, f"connecting to {address} timed out")
        return PeerConnection(stream, address, self._sweeping)

    async def request(
        self,
        address: str,
        method: str,
        args: dict[str, Any] | None = None,
        payload: Buffer | Sequence[Buffer] | None = None,
        timeout: float | None = None,
        after: int | None = None,
    ) -> Response:
        """Call *method* at *address*; returns the result, any raw payload and
        the server's log position. *after*: the log position the server must
        have applied before it runs the call."""
        conn = await self.connection(address)
        return await conn.request(method, args or {}, payload, timeout or self.call_timeout, after)

    async def call(
        self,
        address: str,
        method: str,
        args: dict[str, Any] | None = None,
        payload: Buffer | Sequence[Buffer] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Call *method* at *address* and return its result."""
        return (await self.request(address, method, args, payload, timeout)).result

    def drop(self, address: str) -> None:
        """Forget a peer's connection (after it was found dead)."""
        conn = self._conns.pop(address, None)
        if conn is not None and conn.broken is None:
            conn._fail_all(ConnectionClosed("connection dropped"))
            conn.stream.close()

    async def aclose(self) -> None:
        self.closed = True
        if self._sweep_scope is not None:
            self._sweep_scope.cancel()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()


@asynccontextmanager
async def open_rpc_client(secret: bytes, **kwargs: Any) -> AsyncIterator[RpcClient]:
    async with trio.open_nursery() as nursery:
        client = RpcClient(secret, nursery, **kwargs)
        try:
            yield client
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()
