"""The RPC server: authenticated connections, many requests in flight on each.

Every connection gets its own nursery; each request runs as its own task (at
most ``limits.max_inflight`` per connection, after which the reader stops
reading: backpressure instead of unbounded memory). Replies go back in
completion order. Nothing a peer sends can take the server down: a bad header
closes that connection, a malformed body, an unknown method or a wrongly typed
argument gets an error reply, and a handler that raises something unexpected is
logged with its traceback and answered with EIO.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from shufflefs.rpc import framing
from shufflefs.rpc.auth import server_handshake
from shufflefs.rpc.channel import CHANNEL_METHOD, ChannelServer
from shufflefs.rpc.errors import FsError, as_fs_error
from shufflefs.rpc.metrics import MethodMetrics, ServerMetrics, record_call
from shufflefs.rpc.schema import CallContext, MethodSpec, collect_methods, encode_reply, rpc_method
from shufflefs.rpc.transport import ConnectionClosed, FrameStream, raw_socket

log = logging.getLogger("shufflefs.rpc.server")


class BuiltinService:
    """Methods every server answers."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.started = time.time()
        # requests served per method since start: lets a test (or an operator)
        # see what a client's operation cost the server, e.g. that a cached
        # open made no `open` call
        self.calls: Counter[str] = Counter()
        self.channel_calls: Counter[str] | None = None  # served on thread channels

    @rpc_method(inline=True)
    async def ping(self) -> dict[str, Any]:
        return {"service": self.service, "pid": os.getpid(), "uptime": time.time() - self.started}

    @rpc_method(inline=True)
    async def rpc_calls(self) -> dict[str, int]:
        """Requests answered per method since the server started."""
        return dict(self.calls + self.channel_calls if self.channel_calls else self.calls)


class LogPosition(Protocol):
    """A server that applies a replicated log (a metadata server): every
    reply says how far (``"s"``), and a request carrying ``"s"`` runs only
    once the server has applied that far (docs/protocol.md, "Log positions")."""

    def seq(self) -> int: ...

    async def reach(self, seq: int) -> None:
        """Return once the log is applied through *seq* here, or raise
        (FsError) if this server should not answer such a read now."""
        ...


class RpcServer:
    def __init__(
        self,
        secret: bytes,
        services: Sequence[object],
        *,
        name: str = "rpc",
        limits: framing.Limits = framing.DEFAULT_LIMITS,
        position: LogPosition | None = None,
        channel_threads: int = 0,
    ) -> None:
        """*channel_threads*: serve connections that ask for it on thread
        channels, with this many I/O threads for their blocking calls
        (rpc/channel.py; 0: no channels; never with a log *position*)."""
        self.secret = secret
        self.position = position
        self.name = name
        self.limits = limits
        self.builtin = BuiltinService(name)
        self.methods: dict[str, MethodSpec] = collect_methods(self.builtin, *services)
        self.connections = 0
        self.port: int | None = None
        self.metrics = ServerMetrics(name)
        self.channels: ChannelServer | None = None
        if channel_threads and position is None:
            self.channels = ChannelServer(
                name, self.methods, self.metrics, limits=limits, io_threads=channel_threads
            )
            self.builtin.channel_calls = self.channels.calls

    async def serve(
        self, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on host:port (port 0 picks one) and serve until cancelled.
        Reports the bound port through ``task_status``."""
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        self.port = listeners[0].socket.getsockname()[1]
        log.info("%s listening on %s:%d", self.name, host, self.port)
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, nursery)
                task_status.started(self.port)
        finally:
            if self.channels is not None:
                self.channels.close()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # EMFILE and friends: back off, keep serving
                    log.warning("%s accept failed: %s", self.name, exc)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self._serve_connection, stream.socket)

    async def _serve_connection(self, trio_sock: trio.socket.SocketType) -> None:
        try:
            host, port = trio_sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        stream = FrameStream(raw_socket(trio_sock), self.limits)
        try:
            await server_handshake(stream, self.secret)
        except FsError as exc:
            log.warning("%s refused connection from %s: %s", self.name, peer, exc.message)
            await stream.aclose()
            return
        self.connections += 1
        log.debug("%s connection from %s", self.name, peer)
        try:
            async with trio.open_nursery() as nursery:
                await self._read_loop(stream, peer, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self.connections -= 1
            await stream.aclose()
            log.debug("%s connection from %s closed", self.name, peer)

    async def _read_loop(self, stream: FrameStream, peer: str, nursery: trio.Nursery) -> None:
        inflight = trio.Semaphore(self.limits.max_inflight)
        while True:
            try:
                body, payload = await stream.receive_frame()
            except ConnectionClosed:
                return
            except FsError as exc:
                if exc.code == errno.EBADMSG:  # framing intact: answer and go on
                    log.warning("%s bad frame from %s: %s", self.name, peer, exc.message)
                    await self._send_error(stream, 0, exc)
                    continue
                log.warning("%s closing connection from %s: %s", self.name, peer, exc.message)
                await self._send_error(stream, 0, exc)
                return
            call_id = body.get("i")
            if not isinstance(call_id, int) or isinstance(call_id, bool) or call_id < 0:
                await self._send_error(
                    stream, 0, FsError(errno.EBADMSG, "request id missing or invalid")
                )
                continue
            method = body.get("m")
            if body.get("k") != framing.KIND_REQUEST or not isinstance(method, str):
                await self._send_error(stream, call_id, FsError(errno.EBADMSG, "not a request"))
                continue
            if method == CHANNEL_METHOD and self.channels is not None:
                if await self._hand_over(stream, call_id, peer, inflight):
                    return
                continue
            spec = self.methods.get(method)
            if spec is None:
                await self._send_error(
                    stream, call_id, FsError(errno.ENOSYS, f"unknown method {method[:64]!r}")
                )
                continue
            self.builtin.calls[method] += 1
            args = body.get("a", {})
            after = body.get("s")
            if after is not None and (
                not isinstance(after, int) or isinstance(after, bool) or after < 0
            ):
                await self._send_error(
                    stream, call_id, FsError(errno.EBADMSG, "log position 's' is not a count")
                )
                continue
            if self.position is None:
                after = None  # a server without a log has nothing to wait for
            if after is None:
                if spec.inline:
                    await self._run_call(stream, spec, call_id, args, payload, peer, None)
                    continue
                if spec.fast is not None and await self._try_fast(
                    stream, spec, call_id, args, payload, peer
                ):
                    continue
            await inflight.acquire()
            nursery.start_soon(
                self._run_call, stream, spec, call_id, args, payload, peer, inflight, after
            )

    async def _hand_over(
        self, stream: FrameStream, call_id: int, peer: str, inflight: trio.Semaphore
    ) -> bool:
        """Answer `CHANNEL_METHOD` and give the connection to a thread
        channel (rpc/channel.py). Only before any call runs on it: nothing
        else may be using the socket when it leaves the loop."""
        assert self.channels is not None
        if inflight.value != self.limits.max_inflight:
            error = FsError(errno.EBUSY, "a thread channel is asked for before any other call")
            await self._send_error(stream, call_id, error)
            return False
        self.builtin.calls[CHANNEL_METHOD] += 1
        await stream.send_frame(framing.reply_body(call_id, {"channel": True}))
        sock, leftover = stream.detach()
        self.channels.take(sock, peer, leftover)
        return True

    async def _try_fast(
        self,
        stream: FrameStream,
        spec: MethodSpec,
        call_id: int,
        args: Any,
        payload: bytearray | None,
        peer: str,
    ) -> bool:
        """The synchronous fast path of a call, inline; True if it answered."""
        assert spec.fast is not None
        started = time.perf_counter()
        metrics = self.metrics.method(spec.name)
        try:
            kwargs = spec.bind(args, payload, CallContext(peer, spec.name, call_id))
            result = spec.fast(**kwargs)
        except FsError as exc:
            await self._send_error(stream, call_id, exc, metrics, payload, started)
            return True
        except Exception as exc:
            log.exception("%s %s (fast path) from %s failed", self.name, spec.name, peer)
            await self._send_error(stream, call_id, as_fs_error(exc), metrics, payload, started)
            return True
        if result is None:
            return False
        await self._send_result(stream, call_id, result, metrics, payload, started)
        return True

    async def _send_result(
        self,
        stream: FrameStream,
        call_id: int,
        result: Any,
        metrics: MethodMetrics,
        payload: bytearray | None,
        started: float,
    ) -> None:
        position = self.position.seq() if self.position is not None else None
        body, out_payload = encode_reply(call_id, result, position)
        try:
            await stream.send_frame(body, out_payload)
        except ConnectionClosed:
            pass
        except FsError as exc:  # an oversize reply: tell the caller instead
            await self._send_error(stream, call_id, exc, metrics, payload, started)
            return
        record_call(metrics, payload, started, out_payload)

    async def _run_call(
        self,
        stream: FrameStream,
        spec: MethodSpec,
        call_id: int,
        args: Any,
        payload: bytearray | None,
        peer: str,
        inflight: trio.Semaphore | None,
        after: int | None = None,
    ) -> None:
        started = time.perf_counter()
        metrics = self.metrics.method(spec.name)
        try:
            try:
                if after is not None and self.position is not None:
                    await self.position.reach(after)
                kwargs = spec.bind(args, payload, CallContext(peer, spec.name, call_id))
                result = await spec.func(**kwargs)
            except FsError as exc:
                if exc.code in (errno.EINVAL, errno.EIO):
                    log.info("%s %s from %s: %s", self.name, spec.name, peer, exc.message)
                await self._send_error(stream, call_id, exc, metrics, payload, started)
                return
            except Exception as exc:
                log.exception("%s %s from %s failed", self.name, spec.name, peer)
                await self._send_error(stream, call_id, as_fs_error(exc), metrics, payload, started)
                return
            await self._send_result(stream, call_id, result, metrics, payload, started)
        finally:
            if inflight is not None:
                inflight.release()

    async def _send_error(
        self,
        stream: FrameStream,
        call_id: int,
        error: FsError,
        metrics: MethodMetrics | None = None,
        payload: bytearray | None = None,
        started: float = 0.0,
    ) -> None:
        with contextlib.suppress(FsError):
            await stream.send_frame(framing.error_body(call_id, error))
        if metrics is not None:
            metrics.error(error.code)
            record_call(metrics, payload, started, None)
