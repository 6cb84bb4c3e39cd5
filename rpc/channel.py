"""Thread channels: connections a server serves on threads, off its event loop.

A request served by the trio loop pays for the loop itself: the readiness
wait, the wake-up, the task switch and the scheduler's own bookkeeping. For
a page-cache read that is most of the cost (docs/storage.md, "Thread
channels and the mount's fast READs"). So a client may ask,
with `CHANNEL_METHOD` as the first call on a fresh connection, that its
connection be served by a thread of its own: the server answers, takes the
socket off its loop and hands it to `ChannelServer.take`. From then on the
connection carries the same frames as before, served in a blocking loop:
receive a frame, check it exactly as the loop does (`MethodSpec.bind`), run
the method's synchronous fast path inline, else its blocking implementation
on a shared pool of I/O threads (replies then come back in completion
order, as on any connection).

A method whose blocking implementation waits only for this machine's disks
(``rpc_method(disk_bound=True)``: the storage daemon's reads) runs on the
channel's own thread when the channel has nothing else to do: no other frame
received, none of its calls in the pool. The hand-off to a pool thread (its
wake-up, then the GIL passed between the two threads) was a fifth of a cold
110 KB read's time in the daemon, and a reader of one file at a time leaves
its channel idle while it waits. A call that arrives meanwhile waits in the
socket until that read is done. After one such read took longer than
`SLOW_HERE` (a disk in trouble), the channel hands every call to the pool for
`HERE_BACKOFF`, so one slow disk does not hold up the channel's other reads.

Only methods declared with ``rpc_method(threaded=...)`` are served there;
anything else is answered ENOSYS, so a client sends those on an ordinary
connection. A server that has no channels answers the request itself with
ENOSYS (unknown method): clients then stay on the loop, so old and new
peers mix.

Bad input is handled as on the loop: a malformed body or a wrongly typed
argument gets an error reply and the channel goes on; a bad header closes
the channel; a handler that raises something unexpected is logged and
answered EIO.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shufflefs.rpc import framing
from shufflefs.rpc.errors import FsError, as_fs_error
from shufflefs.rpc.frame_socket import FrameSocket
from shufflefs.rpc.metrics import MethodMetrics, ServerMetrics, record_call
from shufflefs.rpc.schema import CallContext, MethodSpec, encode_reply
from shufflefs.rpc.transport import ConnectionClosed, as_parts

log = logging.getLogger("shufflefs.rpc.channel")

CHANNEL_METHOD = "thread_channel"
MAX_CHANNELS = 1024  # connections served on threads at once, per server
SLOW_HERE = 0.05  # s: a disk-bound call served on the channel's thread slower than this ...
HERE_BACKOFF = 10.0  # s: ... sends the channel's calls to the pool for this long


class _Channel:
    """One handed-over connection: its frames, send lock and in-flight bound.

    Replies the serving thread makes while more requests are already in its
    receive buffer are held back and go out together with the next one it
    sends (one ``sendmsg``, one wake-up of the client for many replies)."""

    def __init__(self, frames: FrameSocket, limits: framing.Limits) -> None:
        self.frames = frames
        self.send_lock = threading.Lock()
        self.inflight = threading.BoundedSemaphore(limits.max_inflight)
        self.broken = False
        self.holding = False  # set by the serving thread: more requests are buffered
        self.held: list[memoryview] = []
        self.serving = threading.get_ident()  # the serving thread (set when it starts)
        self.in_pool = 0  # calls handed to the pool and not done (under pool_lock)
        self.pool_lock = threading.Lock()
        self.here_after = 0.0  # time.monotonic() before which nothing is served here

    def send(self, body: bytes, payload: Sequence[memoryview] = ()) -> None:
        if self.broken:
            return
        size = sum(p.nbytes for p in payload)
        bufs = [memoryview(framing.pack_header(len(body), size) + body), *payload]
        if threading.get_ident() == self.serving:
            if self.holding:
                self.held.extend(bufs)
                return
            bufs, self.held = self.held + bufs, []
        self._send(bufs)

    def flush(self) -> None:
        """(serving thread) Send the replies held back."""
        if self.held:
            bufs, self.held = self.held, []
            self._send(bufs)

    def _send(self, bufs: list[memoryview]) -> None:
        try:
            with self.send_lock:
                self.frames.send(bufs)
        except FsError as exc:
            # a half-sent frame leaves the stream out of sync: end the channel
            log.info("channel to %s: %s; closing it", self.frames.peer, exc.message)
            self.broken = True
            self.frames.shutdown()


class ChannelServer:
    """The thread channels of one rpc server (see the module docstring)."""

    def __init__(
        self,
        name: str,
        methods: dict[str, MethodSpec],
        metrics: ServerMetrics,
        *,
        limits: framing.Limits = framing.DEFAULT_LIMITS,
        io_threads: int = 16,
        max_channels: int = MAX_CHANNELS,
    ) -> None:
        self.name = name
        self.methods = {n: s for n, s in methods.items() if s.threaded is not None}
        self.metrics = metrics
        self.limits = limits
        self.max_channels = max_channels
        self.calls: Counter[str] = Counter()  # requests served per method, as `rpc_calls` counts
        self.served_here = 0  # disk-bound calls served on their channel's thread
        self._calls_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"{name}-channel-io")
        self._channels: set[_Channel] = set()
        self._lock = threading.Lock()
        self.closed = False

    def count(self) -> int:
        return len(self._channels)

    def take(self, sock: socket.socket, peer: str, leftover: bytes) -> bool:
        """Serve *sock* (authenticated, off the loop) on a thread of its own;
        False (and the socket closed) when closed or at the channel limit."""
        frames = FrameSocket(sock, peer, self.limits, self.limits.frame_timeout, leftover)
        channel = _Channel(frames, self.limits)
        with self._lock:
            accepted = not self.closed and len(self._channels) < self.max_channels
            if accepted:
                self._channels.add(channel)
        if not accepted:
            log.warning("%s: no thread channel for %s (closed or at the limit)", self.name, peer)
            channel.frames.close()
            return False
        thread = threading.Thread(
            target=self._serve, args=(channel,), name=f"{self.name}-channel {peer}", daemon=True
        )
        thread.start()
        return True

    def close(self) -> None:
        """Stop serving: every channel's socket is shut (its thread ends on
        EOF) and requests not yet started are dropped."""
        with self._lock:
            self.closed = True
            channels = list(self._channels)
        for channel in channels:
            channel.broken = True
            channel.frames.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- one channel -----------------------------------------------------

    def _serve(self, channel: _Channel) -> None:
        frames = channel.frames
        channel.serving = threading.get_ident()
        log.debug("%s channel from %s open", self.name, frames.peer)
        try:
            while not channel.broken:
                if not frames.frame_buffered():
                    channel.flush()  # before waiting: nothing held while the client waits
                try:
                    body, payload, _ = frames.receive_frame(idle=True)
                except ConnectionClosed:
                    return
                except FsError as exc:
                    if exc.code == errno.EBADMSG:  # framing intact: answer and go on
                        log.warning("%s bad frame from %s: %s", self.name, frames.peer, exc.message)
                        channel.send(framing.error_body(0, exc))
                        continue
                    log.warning(
                        "%s closing channel from %s: %s", self.name, frames.peer, exc.message
                    )
                    channel.send(framing.error_body(0, exc))
                    return
                channel.holding = frames.frame_buffered()
                self._dispatch(channel, body, payload)
        except Exception:
            log.exception("%s channel from %s failed", self.name, frames.peer)
        finally:
            with self._lock:
                self._channels.discard(channel)
            channel.broken = True
            frames.close()
            log.debug("%s channel from %s closed", self.name, frames.peer)

    def _dispatch(self, channel: _Channel, body: dict[Any, Any], payload: bytearray | None) -> None:
        call_id = body.get("i")
        if not isinstance(call_id, int) or isinstance(call_id, bool) or call_id < 0:
            channel.send(
                framing.error_body(0, FsError(errno.EBADMSG, "request id missing or invalid"))
            )
            return
        method = body.get("m")
        if body.get("k") != framing.KIND_REQUEST or not isinstance(method, str):
            channel.send(framing.error_body(call_id, FsError(errno.EBADMSG, "not a request")))
            return
        spec = self.methods.get(method)
        if spec is None:
            error = FsError(errno.ENOSYS, f"{method[:64]!r} is not served on a thread channel")
            channel.send(framing.error_body(call_id, error))
            return
        if body.get("s") is not None:
            error = FsError(errno.EBADMSG, "log positions are not served on a thread channel")
            channel.send(framing.error_body(call_id, error))
            return
        with self._calls_lock:
            self.calls[method] += 1
        started = time.perf_counter()
        metrics = self.metrics.method(method)
        try:
            kwargs = spec.bind(
                body.get("a", {}), payload, CallContext(channel.frames.peer, method, call_id)
            )
            result = spec.fast(**kwargs) if spec.fast is not None else None
        except Exception as exc:
            self._reply_error(channel, spec, call_id, exc, metrics, payload, started)
            return
        if result is not None:
            self._reply(channel, call_id, result, metrics, payload, started)
            return
        channel.inflight.acquire()  # backpressure: stop reading past max_inflight
        if spec.disk_bound and self._idle(channel):
            with self._calls_lock:
                self.served_here += 1
            begun = time.monotonic()
            self._slow(channel, spec, call_id, kwargs, metrics, payload, started)
            if time.monotonic() - begun > SLOW_HERE:
                channel.here_after = time.monotonic() + HERE_BACKOFF
                log.info(
                    "%s channel from %s: a %s took over %.0f ms; its calls go to the pool "
                    "for %.0f s",
                    self.name,
                    channel.frames.peer,
                    spec.name,
                    SLOW_HERE * 1000,
                    HERE_BACKOFF,
                )
            return
        with channel.pool_lock:
            channel.in_pool += 1
        try:
            self._pool.submit(
                self._in_pool, channel, spec, call_id, kwargs, metrics, payload, started
            )
        except RuntimeError:  # the pool was shut down: we are stopping
            with channel.pool_lock:
                channel.in_pool -= 1
            channel.inflight.release()
            channel.broken = True

    @staticmethod
    def _idle(channel: _Channel) -> bool:
        """Whether *channel* has nothing else to do: no other frame received,
        none of its calls in the pool, no slow call here lately."""
        return (
            not channel.holding
            and channel.in_pool == 0
            and not channel.frames.frame_buffered()
            and time.monotonic() >= channel.here_after
        )

    def _slow(
        self,
        channel: _Channel,
        spec: MethodSpec,
        call_id: int,
        kwargs: dict[str, Any],
        metrics: MethodMetrics,
        payload: bytearray | None,
        started: float,
    ) -> None:
        try:
            assert spec.threaded is not None
            result = spec.threaded(**kwargs)
        except Exception as exc:
            self._reply_error(channel, spec, call_id, exc, metrics, payload, started)
        else:
            self._reply(channel, call_id, result, metrics, payload, started)
        finally:
            channel.inflight.release()

    def _in_pool(self, channel: _Channel, *call: Any) -> None:
        """`_slow` on a thread of the pool, counted while it runs (`_idle`)."""
        try:
            self._slow(channel, *call)
        finally:
            with channel.pool_lock:
                channel.in_pool -= 1

    def _reply(
        self,
        channel: _Channel,
        call_id: int,
        result: Any,
        metrics: MethodMetrics,
        payload: bytearray | None,
        started: float,
    ) -> None:
        body, out = encode_reply(call_id, result)
        parts = as_parts(out)
        size = sum(p.nbytes for p in parts)
        if len(body) > self.limits.max_body or size > self.limits.max_payload:
            error = FsError(errno.EMSGSIZE, f"reply of {len(body)}+{size} bytes exceeds the limits")
            channel.send(framing.error_body(call_id, error))
            metrics.error(error.code)
            record_call(metrics, payload, started, None)
            return
        channel.send(body, parts)
        record_call(metrics, payload, started, size)

    def _reply_error(
        self,
        channel: _Channel,
        spec: MethodSpec,
        call_id: int,
        exc: Exception,
        metrics: MethodMetrics,
        payload: bytearray | None,
        started: float,
    ) -> None:
        if isinstance(exc, FsError):
            error = exc
            if error.code in (errno.EINVAL, errno.EIO):
                log.info(
                    "%s %s from %s: %s", self.name, spec.name, channel.frames.peer, error.message
                )
        else:
            log.exception("%s %s from %s failed", self.name, spec.name, channel.frames.peer)
            error = as_fs_error(exc)
        channel.send(framing.error_body(call_id, error))
        metrics.error(error.code)
        record_call(metrics, payload, started, None)
