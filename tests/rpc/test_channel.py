"""Thread channels (rpc/channel.py) against a real server on loopback: the
same calls and checks as on the event loop, replies in completion order,
replies held back while more requests are buffered, bad input answered and
survived, and a blocking client that takes replies in any order."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import trio
from clusters import wait_until

from shufflefs.rpc import FsError, Reply, RpcServer, framing, rpc_method
from shufflefs.rpc.blocking import BlockingConnection, client_handshake
from shufflefs.rpc.channel import CHANNEL_METHOD
from shufflefs.rpc.frame_socket import FrameSocket
from shufflefs.rpc.framing import Limits

SECRET = b"0123456789abcdef0123456789abcdef"


class Blocking:
    """A service with thread-channel implementations (and one without)."""

    def __init__(self) -> None:
        self.slow_release = threading.Event()
        self.threads: set[str] = set()
        self.disk_threads: list[str] = []

    @rpc_method(fast="add_fast", threaded="add_sync")
    async def add(self, a: int, b: int = 0) -> int:
        return a + b

    def add_fast(self, a: int, b: int = 0) -> int | None:
        self.threads.add(threading.current_thread().name)
        return None if a < 0 else a + b  # a negative `a` takes the blocking implementation

    def add_sync(self, a: int, b: int = 0) -> int:
        self.threads.add(threading.current_thread().name)
        if a == -1:
            assert self.slow_release.wait(10)
        return a + b

    @rpc_method(fast="disk_fast", threaded="disk_sync", disk_bound=True)
    async def disk(self, a: int) -> int:
        return a

    def disk_fast(self, a: int) -> int | None:
        return None  # (never in the page cache)

    def disk_sync(self, a: int) -> int:
        self.disk_threads.append(threading.current_thread().name)
        if a < 0:
            time.sleep(-a / 1000)  # a slow disk: -a ms
        return a

    @rpc_method(threaded="upper_sync")
    async def upper(self, payload: bytearray | None) -> Reply:
        return self.upper_sync(payload)

    def upper_sync(self, payload: bytearray | None) -> Reply:
        assert payload is not None
        return Reply({"n": len(payload)}, [bytes(payload).upper(), b"!"])

    @rpc_method(threaded="crash_sync")
    async def crash(self) -> None:
        raise RuntimeError("bug")

    def crash_sync(self) -> None:
        raise RuntimeError("bug in a blocking handler")

    @rpc_method
    async def loop_only(self) -> int:
        return 7

    @rpc_method
    async def nap(self, seconds: float) -> int:
        await trio.sleep(seconds)
        return 1


def serve_in_thread(
    limits: Limits = framing.DEFAULT_LIMITS, channel_threads: int = 4
) -> Iterator[tuple[str, RpcServer, Blocking]]:
    """A server on its own trio loop in a thread (the test's thread blocks
    on sockets, as the clients of channels do)."""
    service = Blocking()
    server = RpcServer(
        SECRET, [service], name="chan", limits=limits, channel_threads=channel_threads
    )
    ready = threading.Event()
    port: list[int] = []
    token: list[trio.lowlevel.TrioToken] = []
    stop = threading.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port.append(await nursery.start(server.serve, "127.0.0.1", 0))
            token.append(trio.lowlevel.current_trio_token())
            ready.set()
            await trio.to_thread.run_sync(stop.wait)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"127.0.0.1:{port[0]}", server, service
    finally:
        service.slow_release.set()
        stop.set()
        thread.join(10)


@pytest.fixture
def served() -> Iterator[tuple[str, RpcServer, Blocking]]:
    yield from serve_in_thread()


def raw_channel(address: str) -> FrameSocket:
    """An authenticated socket that asked for a channel, for hand-made frames."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    frames = FrameSocket(sock, address, framing.DEFAULT_LIMITS, 5.0)
    client_handshake(frames, SECRET)
    frames.send_frame(framing.request_body(1, CHANNEL_METHOD, {}))
    body, _, _ = frames.receive_frame()
    assert body["r"] == {"channel": True}
    return frames


def call(conn: BlockingConnection, method: str, args: dict[str, Any]) -> Any:
    return conn.receive_reply(conn.send_request(method, args))[0]


def test_calls_run_on_threads_with_the_loops_checks(served: Any) -> None:
    address, _, service = served
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    assert conn.channel
    assert call(conn, "add", {"a": 2, "b": 3}) == 5  # the fast path, inline
    assert call(conn, "add", {"a": -5, "b": 6}) == 1  # the blocking one, on the pool
    result, payload = conn.receive_reply(conn.send_request("upper", {}, b"abc"))
    assert result == {"n": 3} and bytes(payload or b"") == b"ABC!"
    assert not any(name.startswith("trio") for name in service.threads)
    assert any(name.startswith("chan-channel 127.0.0.1") for name in service.threads)
    assert any(name.startswith("chan-channel-io") for name in service.threads)
    for method, args, code in [
        ("add", {"a": "1"}, errno.EINVAL),
        ("add", {"a": True}, errno.EINVAL),
        ("add", {}, errno.EINVAL),
        ("add", {"a": 1, "c": 2}, errno.EINVAL),
        ("loop_only", {}, errno.ENOSYS),  # no blocking implementation: not served here
        ("no_such_method", {}, errno.ENOSYS),
        ("crash", {}, errno.EIO),
    ]:
        with pytest.raises(FsError) as info:
            call(conn, method, args)
        assert info.value.errno == code, (method, args)
    assert call(conn, "add", {"a": 1}) == 1  # the channel still serves
    plain = BlockingConnection(address, SECRET, 5.0)
    assert not plain.channel and call(plain, "loop_only", {}) == 7
    calls = call(plain, "rpc_calls", {})
    assert calls["add"] >= 3 and calls[CHANNEL_METHOD] == 1


def test_replies_come_in_completion_order_and_are_matched(served: Any) -> None:
    address, _, service = served
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    slow = conn.send_request("add", {"a": -1, "b": 1})  # waits on the pool
    fast = [conn.send_request("add", {"a": i, "b": 1}) for i in range(20)]
    # the fast ones are answered while the slow one waits: taken in any order
    assert [conn.receive_reply(c)[0] for c in reversed(fast)] == [
        i + 1 for i in reversed(range(20))
    ]
    service.slow_release.set()
    assert conn.receive_reply(slow)[0] == 0


HERE = "chan-channel 127.0.0.1"  # a channel's own thread (its pool's: "chan-channel-io")


def test_a_disk_bound_call_runs_on_an_idle_channels_own_thread(served: Any) -> None:
    """No hand-off to the pool when the channel has nothing else to do."""
    address, server, service = served
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    assert [call(conn, "disk", {"a": i}) for i in range(5)] == list(range(5))
    assert all(name.startswith(HERE) for name in service.disk_threads)
    assert server.channels.served_here == 5
    call(conn, "add", {"a": -5, "b": 6})  # not disk-bound: the pool, as before
    assert any(name.startswith("chan-channel-io") for name in service.threads)


def test_with_a_call_in_the_pool_a_disk_bound_one_goes_there_too(served: Any) -> None:
    """A channel busy with another call does not make it wait for a disk."""
    address, server, service = served
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    slow = conn.send_request("add", {"a": -1, "b": 1})  # waits in the pool
    wait_until(
        "the first call running in the pool",
        lambda: any(n.startswith("chan-channel-io") for n in service.threads),
        timeout=5,
    )
    assert call(conn, "disk", {"a": 7}) == 7  # answered while the first still waits
    assert service.disk_threads[-1].startswith("chan-channel-io")
    assert server.channels.served_here == 0
    service.slow_release.set()
    assert conn.receive_reply(slow)[0] == 0
    assert call(conn, "disk", {"a": 8}) == 8  # idle again: here
    assert service.disk_threads[-1].startswith(HERE)


def test_after_a_slow_disk_call_the_channel_uses_its_pool_for_a_while(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shufflefs.rpc import channel as channel_module

    monkeypatch.setattr(channel_module, "SLOW_HERE", 0.02)
    monkeypatch.setattr(channel_module, "HERE_BACKOFF", 0.5)
    address, server, service = served
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    assert call(conn, "disk", {"a": -60}) == -60  # 60 ms, here: too slow
    assert service.disk_threads[-1].startswith(HERE)
    assert call(conn, "disk", {"a": 1}) == 1
    assert service.disk_threads[-1].startswith("chan-channel-io")  # backing off
    backing_off = time.monotonic()

    def served_here_again() -> bool:
        assert call(conn, "disk", {"a": 2}) == 2
        return service.disk_threads[-1].startswith(HERE)

    wait_until("the backoff's end", served_here_again, timeout=5)
    assert time.monotonic() - backing_off > 0.4  # not before it ended
    assert server.channels.served_here == 2


def test_pipelined_requests_all_answered_and_held_replies_flushed(served: Any) -> None:
    """Many requests in one send: the server holds replies while more are
    buffered and sends them together; each one arrives, none is stuck."""
    address, _, _ = served
    frames = raw_channel(address)
    bodies = [framing.request_body(i, "add", {"a": i, "b": 1}) for i in range(2, 202)]
    bodies += [framing.request_body(i, "disk", {"a": i}) for i in range(202, 262)]
    frames.send([memoryview(framing.pack_header(len(b), 0) + b) for b in bodies])
    got = {}
    while len(got) < len(bodies):
        body, _, _ = frames.receive_frame()
        got[body["i"]] = body["r"]
    assert got == {i: (i + 1 if i < 202 else i) for i in range(2, 262)}


def test_bad_input_is_answered_and_the_channel_survives_or_closes(served: Any) -> None:
    address, _, _ = served
    frames = raw_channel(address)
    garbage = b"\xc1\xc1"  # not msgpack
    frames.send([memoryview(framing.pack_header(len(garbage), 0) + garbage)])
    body, _, _ = frames.receive_frame()
    assert body["i"] == 0 and body["e"][0] == errno.EBADMSG
    not_a_map = msgpack.packb([1, 2])
    frames.send([memoryview(framing.pack_header(len(not_a_map), 0) + not_a_map)])
    assert frames.receive_frame()[0]["e"][0] == errno.EBADMSG
    for bad in (
        {"k": 0, "i": -3, "m": "add", "a": {"a": 1}},  # bad id
        {"k": 1, "i": 5, "m": "add", "a": {"a": 1}},  # not a request
        {"k": 0, "i": 6, "m": "add", "a": {"a": 1}, "s": 3},  # a log position
    ):
        packed = msgpack.packb(bad)
        frames.send([memoryview(framing.pack_header(len(packed), 0) + packed)])
        assert frames.receive_frame()[0]["e"][0] in (errno.EBADMSG, errno.EINVAL)
    frames.send_frame(framing.request_body(9, "add", {"a": 4}))
    assert frames.receive_frame()[0]["r"] == 4  # still serving
    # a header past the limits: answered, then the channel is closed
    frames.send([memoryview(struct.pack("<HHII", framing.MAGIC, framing.VERSION, 1 << 30, 0))])
    body, _, _ = frames.receive_frame()
    assert body["e"][0] == errno.EMSGSIZE
    with pytest.raises(FsError):
        frames.receive_frame()
    # the server serves everyone else
    assert call(BlockingConnection(address, SECRET, 5.0, channel=True), "add", {"a": 1}) == 1


def test_a_channel_is_asked_for_before_any_other_call(served: Any) -> None:
    """With a call still running on the loop the socket cannot leave it:
    EBUSY, and the connection goes on as an ordinary one."""
    address, _, _ = served
    host, port = address.rsplit(":", 1)
    frames = FrameSocket(
        socket.create_connection((host, int(port)), timeout=5), address, framing.DEFAULT_LIMITS, 5
    )
    client_handshake(frames, SECRET)
    frames.send_frame(framing.request_body(1, "nap", {"seconds": 0.5}))
    frames.send_frame(framing.request_body(2, CHANNEL_METHOD, {}))
    body, _, _ = frames.receive_frame()
    assert body["i"] == 2 and body["e"][0] == errno.EBUSY
    assert frames.receive_frame()[0] == {"k": 1, "i": 1, "r": 1}
    frames.send_frame(framing.request_body(3, "loop_only", {}))
    assert frames.receive_frame()[0]["r"] == 7


def test_a_server_without_channels_keeps_its_connections() -> None:
    served = serve_in_thread(channel_threads=0)
    address, server, _ = next(served)
    try:
        assert server.channels is None
        conn = BlockingConnection(address, SECRET, 5.0, channel=True)
        assert not conn.channel  # ENOSYS: an ordinary connection
        assert call(conn, "loop_only", {}) == 7
        assert call(conn, "add", {"a": 2, "b": 2}) == 4
    finally:
        next(served, None)


def test_stopping_the_server_ends_its_channels() -> None:
    served = serve_in_thread()
    address, server, _ = next(served)
    conn = BlockingConnection(address, SECRET, 5.0, channel=True)
    assert call(conn, "add", {"a": 1}) == 1
    assert server.channels is not None and server.channels.count() == 1
    next(served, None)  # stops the loop: the server closes its channels
    deadline = time.monotonic() + 5
    while server.channels.count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.channels.count() == 0
    with pytest.raises(FsError):
        call(conn, "add", {"a": 1})


def test_a_payload_lands_in_many_buffers_whatever_the_receives() -> None:
    """`receive_frame` with a placer: the payload fills the given views in
    order (empty ones skipped, more than one sendmsg's worth of them), part
    from what the header's receive buffered, the rest straight from the
    socket, a receive buffer's worth at a time."""
    a, b = socket.socketpair()
    try:
        # a small send buffer: the frame arrives in pieces (the first with the
        # header, the body and part of the payload), whatever the timing
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2048)
        receiver = FrameSocket(b, "pair", framing.DEFAULT_LIMITS, 5.0)
        payload = bytes(range(256)) * 40  # 10,240 bytes
        sizes = [0, 1, 7, 0, 4096, *([3] * 600), 13]
        sizes.append(len(payload) - sum(sizes))
        body = framing.pack_body({"k": 1, "i": 9, "r": sizes})
        frame = framing.pack_header(len(body), len(payload)) + body + payload

        sender = threading.Thread(target=a.sendall, args=(frame,))
        sender.start()
        out = bytearray(len(payload))
        view = memoryview(out)

        def place(got: dict[Any, Any], size: int) -> list[memoryview]:
            assert size == len(payload)
            views, pos = [], 0
            for n in got["r"]:
                views.append(view[pos : pos + n])
                pos += n
            return views

        got, data, placed = receiver.receive_frame(place)
        sender.join()
        assert placed and data is None and got["i"] == 9
        assert bytes(out) == payload
    finally:
        a.close()
        b.close()
