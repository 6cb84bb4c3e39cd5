"""The rpc layer against a real server on loopback: multiplexing, auth, limits."""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any, NotRequired, TypedDict

import msgpack
import pytest
import trio

from shufflefs.rpc import FsError, Reply, RpcServer, framing, open_rpc_client, rpc_method
from shufflefs.rpc.auth import GREETING, MAC, NONCE, proof
from shufflefs.rpc.framing import Limits

SECRET = b"0123456789abcdef0123456789abcdef"


class Item(TypedDict):
    name: bytes
    size: int
    extra: NotRequired[int]  # (a string annotation here: the module's __future__ import)


class Echo:
    def __init__(self) -> None:
        self.release = trio.Event()
        self.blocked = trio.Event()  # a `block` call has arrived

    @rpc_method
    async def echo(self, value: Any) -> Any:
        return value

    @rpc_method
    async def add(self, a: int, b: int = 0) -> int:
        return a + b

    @rpc_method
    async def sleep_then(self, seconds: float, value: int) -> int:
        await trio.sleep(seconds)
        return value

    @rpc_method
    async def fail(self, code: int) -> None:
        raise FsError(code, "asked to fail")

    @rpc_method
    async def crash(self) -> None:
        raise RuntimeError("bug in handler")

    @rpc_method
    async def items(self, items: list[Item], tag: str | None = None) -> int:
        return sum(i["size"] + i.get("extra", 0) for i in items)

    @rpc_method
    async def upper(self, payload: bytearray | None) -> Reply:
        assert payload is not None
        return Reply({"n": len(payload)}, [bytes(payload).upper(), b"!"])

    @rpc_method
    async def block(self) -> None:
        self.blocked.set()
        await self.release.wait()


async def start(nursery: trio.Nursery, limits: Limits = framing.DEFAULT_LIMITS) -> str:
    server = RpcServer(SECRET, [Echo()], name="test", limits=limits)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def test_calls_and_errors(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    async with open_rpc_client(SECRET) as rpc:
        assert await rpc.call(addr, "add", {"a": 2, "b": 3}) == 5
        assert await rpc.call(addr, "add", {"a": 2}) == 5 - 3
        assert await rpc.call(addr, "echo", {"value": {"x": [1, b"\xff"]}}) == {"x": [1, b"\xff"]}
        with pytest.raises(FsError) as info:
            await rpc.call(addr, "fail", {"code": errno.ENOSPC})
        assert info.value.errno == errno.ENOSPC and "asked to fail" in str(info.value)
        with pytest.raises(FsError) as info:
            await rpc.call(addr, "crash")
        assert info.value.errno == errno.EIO
        assert (await rpc.call(addr, "ping"))["service"] == "test"


@pytest.mark.parametrize(
    "method,args",
    [
        ("add", {"a": "1"}),
        ("add", {"a": True}),
        ("add", {}),
        ("add", {"a": 1, "c": 2}),
        ("items", {"items": [{"name": "str-not-bytes", "size": 1}]}),
        ("items", {"items": [{"name": b"x"}]}),
        ("items", {"items": {"name": b"x", "size": 1}}),
        ("items", {"items": [], "tag": 5}),
        ("items", {"items": [{"name": b"x", "size": 1, "extra": "1"}]}),
        ("items", {"items": [{"name": b"x", "size": 1, "other": 1}]}),
    ],
)
async def test_wrong_argument_types_get_einval(
    nursery: trio.Nursery, method: str, args: dict[str, Any]
) -> None:
    addr = await start(nursery)
    async with open_rpc_client(SECRET) as rpc:
        with pytest.raises(FsError) as info:
            await rpc.call(addr, method, args)
        assert info.value.errno == errno.EINVAL
        assert await rpc.call(addr, "add", {"a": 1}) == 1  # connection still good


async def test_a_not_required_field_may_be_left_out_and_is_checked_when_given(
    nursery: trio.Nursery,
) -> None:
    addr = await start(nursery)
    async with open_rpc_client(SECRET) as rpc:
        one = {"name": b"x", "size": 1}
        assert await rpc.call(addr, "items", {"items": [one, {**one, "extra": 5}]}) == 7


async def test_unknown_method(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    async with open_rpc_client(SECRET) as rpc:
        with pytest.raises(FsError) as info:
            await rpc.call(addr, "no_such_method")
        assert info.value.errno == errno.ENOSYS


async def test_out_of_order_replies_on_one_connection(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    results: dict[int, int] = {}
    async with open_rpc_client(SECRET) as rpc:

        async def one(i: int) -> None:
            results[i] = await rpc.call(
                addr, "sleep_then", {"seconds": (10 - i) * 0.02, "value": i}
            )

        async with trio.open_nursery() as n:
            for i in range(10):
                n.start_soon(one, i)
        assert results == {i: i for i in range(10)}
        assert len(rpc._conns) == 1


async def test_payload_round_trip(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    data = bytes(range(256)) * 4096 + b"tail"
    async with open_rpc_client(SECRET) as rpc:
        resp = await rpc.request(addr, "upper", {}, payload=data)
        assert resp.result == {"n": len(data)}
        assert resp.payload == data.upper() + b"!"


async def test_timeout(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    async with open_rpc_client(SECRET) as rpc:
        with pytest.raises(FsError) as info:
            await rpc.call(addr, "sleep_then", {"seconds": 5, "value": 1}, timeout=0.1)
        assert info.value.errno == errno.ETIMEDOUT
        assert await rpc.call(addr, "add", {"a": 7}) == 7


async def test_wrong_secret_refused(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    async with open_rpc_client(b"another-secret-another-secret!!") as rpc:
        with pytest.raises(FsError) as info:
            await rpc.call(addr, "ping")
        assert info.value.errno in (errno.EACCES, errno.ECONNRESET)
    async with open_rpc_client(SECRET) as rpc:
        assert (await rpc.call(addr, "ping"))["service"] == "test"


async def test_connection_refused(nursery: trio.Nursery) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    async with open_rpc_client(SECRET) as rpc:
        with pytest.raises(FsError) as info:
            await rpc.call(f"127.0.0.1:{port}", "ping")
        assert info.value.errno == errno.ECONNREFUSED


# ---- raw-socket abuse: the server must answer or close, and keep serving ----


async def raw_connect(addr: str) -> trio.SocketStream:
    host, port = addr.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    hello = await receive_exactly(stream, len(GREETING) + NONCE)
    server_nonce = hello[len(GREETING) :]
    client_nonce = b"n" * NONCE
    await stream.send_all(client_nonce + proof(SECRET, b"client", server_nonce, client_nonce))
    await receive_exactly(stream, 2 + MAC)
    return stream


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


async def read_reply(stream: trio.SocketStream) -> dict[Any, Any]:
    header = await receive_exactly(stream, framing.HEADER_SIZE)
    _, _, body_len, payload_len = framing.HEADER.unpack(header)
    body = await receive_exactly(stream, body_len)
    await receive_exactly(stream, payload_len) if payload_len else None
    return msgpack.unpackb(body, raw=False)


async def test_malformed_msgpack_gets_error_and_connection_survives(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    stream = await raw_connect(addr)
    garbage = b"\xc1\xc1\xc1"
    await stream.send_all(framing.pack_header(len(garbage), 0) + garbage)
    reply = await read_reply(stream)
    assert reply["e"][0] == errno.EBADMSG
    body = framing.request_body(5, "add", {"a": 1})
    await stream.send_all(framing.pack_header(len(body), 0) + body)
    reply = await read_reply(stream)
    assert reply == {"k": 1, "i": 5, "r": 1}


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2]),
        msgpack.packb({"k": 0, "i": "x", "m": "add"}),
        msgpack.packb({"k": 0, "i": 3, "m": 7, "a": {}}),
        msgpack.packb({"k": 0, "i": 3, "m": "add", "a": [1]}),
    ],
)
async def test_wrong_shapes_get_errors(nursery: trio.Nursery, body: bytes) -> None:
    addr = await start(nursery)
    stream = await raw_connect(addr)
    await stream.send_all(framing.pack_header(len(body), 0) + body)
    reply = await read_reply(stream)
    assert reply["e"][0] in (errno.EBADMSG, errno.EINVAL)


async def test_oversize_frame_closes_connection_not_server(nursery: trio.Nursery) -> None:
    addr = await start(nursery, Limits(max_body=4096, max_payload=1 << 16))
    stream = await raw_connect(addr)
    await stream.send_all(framing.pack_header(1 << 30, 0))  # claims 1 GiB: must not allocate
    reply = await read_reply(stream)
    assert reply["e"][0] == errno.EMSGSIZE
    assert await stream.receive_some(10) == b""  # closed
    stream2 = await raw_connect(addr)
    await stream2.send_all(framing.pack_header(8, 1 << 20))
    reply = await read_reply(stream2)
    assert reply["e"][0] == errno.EMSGSIZE
    async with open_rpc_client(SECRET) as rpc:
        assert await rpc.call(addr, "add", {"a": 3}) == 3


async def test_bad_magic_closes(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    stream = await raw_connect(addr)
    await stream.send_all(struct.pack("<HHII", 0xDEAD, 1, 4, 0) + b"abcd")
    reply = await read_reply(stream)
    assert reply["e"][0] == errno.EPROTO
    async with open_rpc_client(SECRET) as rpc:
        assert await rpc.call(addr, "add", {"a": 3}) == 3


async def test_garbage_instead_of_handshake(nursery: trio.Nursery) -> None:
    addr = await start(nursery)
    host, port = addr.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"GET / HTTP/1.0\r\n\r\n" * 10)
    with trio.fail_after(10):
        while await stream.receive_some(1000):
            pass
    async with open_rpc_client(SECRET) as rpc:
        assert await rpc.call(addr, "add", {"a": 3}) == 3


async def test_truncated_frame_times_out(nursery: trio.Nursery) -> None:
    addr = await start(nursery, Limits(frame_timeout=0.3))
    stream = await raw_connect(addr)
    await stream.send_all(framing.pack_header(100, 0) + b"\x80")
    with trio.fail_after(5):
        data = await stream.receive_some(1000)
        while data:
            data = await stream.receive_some(1000)


async def test_many_in_flight_backpressure(nursery: trio.Nursery) -> None:
    addr = await start(nursery, Limits(max_inflight=4))
    async with open_rpc_client(SECRET) as rpc:
        out: list[int] = []

        async def one(i: int) -> None:
            out.append(await rpc.call(addr, "sleep_then", {"seconds": 0.01, "value": i}))

        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(one, i)
        assert sorted(out) == list(range(50))


async def test_server_restart_fails_inflight_then_reconnects(nursery: trio.Nursery) -> None:
    echo = Echo()
    server = RpcServer(SECRET, [echo], name="test")
    async with trio.open_nursery() as inner:
        port = await inner.start(server.serve, "127.0.0.1", 0)
        addr = f"127.0.0.1:{port}"
        async with open_rpc_client(SECRET) as rpc:

            async def blocked() -> None:
                with pytest.raises(FsError) as info:
                    await rpc.call(addr, "block", timeout=5)
                assert info.value.errno == errno.ECONNRESET

            async with trio.open_nursery() as n:
                n.start_soon(blocked)
                with trio.fail_after(5):
                    await echo.blocked.wait()
                inner.cancel_scope.cancel()
    server2 = RpcServer(SECRET, [Echo()], name="test")
    await nursery.start(server2.serve, "127.0.0.1", port)
    async with open_rpc_client(SECRET) as rpc:
        assert await rpc.call(addr, "add", {"a": 1}) == 1


# ---- log positions (a replicated log's server: read-your-writes) ----------------


class Log:
    """A `LogPosition` whose log the test moves on by hand."""

    def __init__(self) -> None:
        self.applied = 3
        self.moved = trio.Event()

    def seq(self) -> int:
        return self.applied

    def advance(self, to: int) -> None:
        self.applied = to
        self.moved.set()
        self.moved = trio.Event()

    async def reach(self, seq: int) -> None:
        with trio.move_on_after(1.0):
            while self.applied < seq:
                await self.moved.wait()
            return
        raise FsError(errno.EAGAIN, f"behind: {self.applied} < {seq}")


async def test_replies_carry_the_position_and_requests_wait_for_theirs(
    nursery: trio.Nursery,
) -> None:
    log = Log()
    server = RpcServer(SECRET, [Echo()], name="test", position=log)
    addr = f"127.0.0.1:{await nursery.start(server.serve, '127.0.0.1', 0)}"
    async with open_rpc_client(SECRET) as rpc:
        plain = await rpc.request(addr, "add", {"a": 1})
        assert (plain.result, plain.position) == (1, 3)
        got: list[Any] = []

        async def read_after(seq: int) -> None:
            got.append(await rpc.request(addr, "add", {"a": 2}, after=seq))

        async with trio.open_nursery() as waiting:
            waiting.start_soon(read_after, 5)
            await trio.sleep(0.1)
            assert got == []  # the server has applied 3 of 5: the call waits
            log.advance(4)
            await trio.sleep(0.05)
            assert got == []
            log.advance(6)
        assert (got[0].result, got[0].position) == (2, 6)
        with pytest.raises(FsError) as info:  # never gets there: refused, not hung
            await rpc.request(addr, "add", {"a": 2}, after=100)
        assert info.value.errno == errno.EAGAIN
        # a server without a log ignores a position; a bad one is EBADMSG
        bare = await start(nursery)
        assert (await rpc.request(bare, "add", {"a": 1}, after=100)).position is None
    stream = await raw_connect(addr)
    for bad in (-1, "7", True):
        body = msgpack.packb({"k": 0, "i": 9, "m": "add", "a": {"a": 1}, "s": bad})
        await stream.send_all(framing.pack_header(len(body), 0) + body)
        assert (await read_reply(stream))["e"][0] == errno.EBADMSG
