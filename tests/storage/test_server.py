"""The storage service behind a real RpcServer on loopback, called through
StorageStub over a real RpcClient; and `serve` against a fake mgmtd."""

from __future__ import annotations

import errno
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import flip

from shufflefs.cluster.protocol import (
    RegisterResult,
    RoutingInfo,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.cluster.routing import Routing
from shufflefs.rpc import FsError, RpcClient, RpcServer, open_rpc_client, rpc_method
from shufflefs.rpc.framing import Limits
from shufflefs.storage.config import StorageConfig, load_storage_config
from shufflefs.storage.daemon import serve
from shufflefs.storage.protocol import MAX_READ_ITEMS, StorageStub, chunk_id
from shufflefs.storage.service import StorageService
from shufflefs.storage.store import ChunkStore

SECRET = b"0123456789abcdef0123456789abcdef"
CS = 1 << 16


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[ChunkStore]]:
    opened = []
    for tid in (1, 2):
        store = ChunkStore(tmp_path / f"t{tid}", block_size=512, fsync=False, reserve_bytes=0)
        store.set_identity(tid, "test")
        opened.append(store)
    yield opened
    for store in opened:
        store.close()


async def start(
    nursery: trio.Nursery,
    stores: list[ChunkStore],
    *,
    routing: Any = None,
    limits: Limits | None = None,
    max_read_bytes: int = 64 << 20,
    rpc: RpcClient | None = None,
) -> str:
    service = StorageService(
        stores, io_threads=4, routing=routing, max_read_bytes=max_read_bytes, rpc=rpc
    )
    server = RpcServer(SECRET, [service], name="storage", limits=limits or Limits())
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def test_batched_read_across_chunks_and_targets(
    nursery: trio.Nursery, stores: list[ChunkStore]
) -> None:
    addr = await start(nursery, stores)
    a, b, c, bad = chunk_id(1, 0), chunk_id(1, 1), chunk_id(2, 0), chunk_id(3, 0)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        data_a = os.urandom(5000)
        data_c = os.urandom(3000)
        assert await stub.write(1, 0, 0, a, 0, CS, data_a) == {"version": 1, "length": 5000}
        await stub.write(1, 0, 0, b, 100, CS, b"bee")
        await stub.write(2, 0, 0, c, 0, CS, data_c)
        await stub.write(1, 0, 0, bad, 0, CS, b"x" * 2048)
        path = stores[0].file_path(bad)
        assert path is not None
        flip(path, 1500)  # block 2 of 4
        items = [
            (1, a, 10, 1000),
            (2, c, 2900, 500),  # short: the chunk ends at 3000
            (1, chunk_id(9, 9), 0, 100),  # missing chunk: 0 bytes
            (7, a, 0, 10),  # unknown target
            (1, a, CS - 10, 20),  # past the chunk size
            (1, bad, 0, 2048),  # touches the damaged block
            (1, bad, 0, 1024),  # does not
            (1, b, 0, 200),  # gap then data
            (1, b"short", 0, 1),
        ]
        lengths, payload = await stub.read(items)
        assert lengths == [
            1000,
            100,
            0,
            -errno.ENOENT,
            -errno.EINVAL,
            -errno.EIO,
            1024,
            103,
            -errno.EINVAL,
        ]
        expected = data_a[10:1010] + data_c[2900:] + b"x" * 1024 + bytes(100) + b"bee"
        assert bytes(payload) == expected  # the damaged block's bytes are not in it
        # the same again (now from the caches and the page cache) and many items at once
        again, payload2 = await stub.read(items)
        assert again == lengths and payload2 == payload
        many = [(1, a, i * 50, 50) for i in range(100)]
        lengths, payload = await stub.read(many)
        assert lengths == [50] * 100 and bytes(payload) == data_a
        assert await stub.read([]) == ([], bytearray())


async def test_cold_reads_run_in_threads(nursery: trio.Nursery, stores: list[ChunkStore]) -> None:
    addr = await start(nursery, stores)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        blobs = {i: os.urandom(700 + i) for i in range(30)}
        for i, blob in blobs.items():
            await stub.write(1 + i % 2, 0, 0, chunk_id(20, i), 0, CS, blob)
        for store in stores:  # forget every cached record and fd
            store._records.clear()
            store._fds.close_all()
        items = [(1 + i % 2, chunk_id(20, i), 0, 2000) for i in blobs]
        lengths, payload = await stub.read(items)
        assert lengths == [len(b) for b in blobs.values()]
        assert bytes(payload) == b"".join(blobs.values())


async def test_bad_requests_get_errors_and_the_server_keeps_serving(
    nursery: trio.Nursery, stores: list[ChunkStore]
) -> None:
    addr = await start(nursery, stores, limits=Limits(max_payload=1 << 20), max_read_bytes=1 << 20)
    cid = chunk_id(4, 0)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        await stub.write(1, 0, 0, cid, 0, CS, b"keep")

        async def fails(code: int | tuple[int, ...], method: str, args: dict[str, Any]) -> None:
            with pytest.raises(FsError) as info:
                await rpc.call(addr, method, args, payload=args.pop("_payload", None))
            assert info.value.errno in (code if isinstance(code, tuple) else (code,))
            assert (await stub.read([(1, cid, 0, 10)]))[1] == b"keep"

        good = {"target": 1, "chain": 0, "chain_version": 0, "chunk": cid, "offset": 0}
        await fails(errno.ENOENT, "write", {**good, "target": 5, "chunk_size": CS})
        await fails(errno.EINVAL, "write", {**good, "chunk_size": 4096, "_payload": b"x" * 5000})
        await fails(errno.EINVAL, "write", {**good, "chunk_size": 3000, "_payload": b"x"})
        await fails(errno.EINVAL, "write", {**good, "chunk": b"abc", "chunk_size": CS})
        await fails(errno.EINVAL, "write", {**good, "offset": "0", "chunk_size": CS})
        await fails(errno.EINVAL, "write", {**good, "chunk_size": CS, "extra": 1})
        await fails(errno.EINVAL, "write", {**good})  # chunk_size missing
        await fails(errno.EINVAL, "read", {"items": [[1, cid, 0]]})
        await fails(errno.EINVAL, "read", {"items": [["1", cid, 0, 1]]})
        await fails(errno.EINVAL, "read", {"items": {"a": 1}})
        file_op = {"target": 1, "chain": 0, "chain_version": 0, "ino": 4}
        await fails(errno.EINVAL, "truncate_file", {**file_op, "size": -1, "chunk_size": CS})
        await fails(errno.EINVAL, "truncate_file", {**file_op, "size": 0, "chunk_size": 3000})
        await fails(errno.EINVAL, "remove_file", {**file_op, "ino": -1})
        files_op = {"target": 1, "chain": 0, "chain_version": 0}
        await fails(errno.EINVAL, "remove_files", {**files_op, "inos": [4, -1]})
        await fails(errno.EINVAL, "remove_files", {**files_op, "inos": [4, "5"]})
        await fails(errno.EINVAL, "remove_files", {**files_op, "inos": 4})
        await fails(errno.EINVAL, "remove_files", {**files_op, "inos": list(range(1025))})
        await fails(errno.EINVAL, "list_chunks", {"target": 1, "limit": 0})
        await fails(errno.EINVAL, "stats", {"_payload": b"unexpected"})
        await fails(errno.EMSGSIZE, "read", {"items": [[1, cid, 0, 600_000], [1, cid, 0, 600_000]]})
        # a payload over the frame limit: refused (the connection is dropped),
        # and the next call gets a fresh connection that works
        await fails(
            (errno.EMSGSIZE, errno.ECONNRESET),
            "write",
            {**good, "chunk_size": 4 << 20, "_payload": bytes(2 << 20)},
        )
        info = await stub.chunk_info(1, cid)
        assert (info["version"], info["length"], info["block_size"]) == (1, 4, 512)


async def test_file_operations_over_rpc(nursery: trio.Nursery, stores: list[ChunkStore]) -> None:
    addr = await start(nursery, stores)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        for idx in range(3):
            await stub.write(1, 0, 0, chunk_id(50, idx), 0, 4096, bytes([idx]) * 4096)
        assert await stub.truncate_file(1, 0, 0, 50, 4096 + 10, 4096) == 2
        info = await stub.chunk_info(1, chunk_id(50, 1))
        assert info["length"] == 10 and info["version"] == 2 and len(info["crcs"]) == 4
        page = await stub.list_chunks(1)
        assert [c["chunk"] for c in page["chunks"]] == [chunk_id(50, 0), chunk_id(50, 1)]
        page = await stub.list_chunks(1, after=chunk_id(50, 0), limit=1)
        assert [c["chunk"] for c in page["chunks"]] == [chunk_id(50, 1)] and not page["more"]
        stats = {s["target_id"]: s for s in await stub.stats()}
        assert set(stats) == {1, 2}
        assert stats[1]["chunks"] == 2 and stats[1]["used"] == 4096 + 10
        assert stats[1]["capacity"] > 0 and stats[2]["chunks"] == 0
        assert await stub.remove_file(1, 0, 0, 50) == 2
        assert (await stub.list_chunks(1))["chunks"] == []
        with pytest.raises(FsError) as err:
            await stub.chunk_info(1, chunk_id(50, 0))
        assert err.value.errno == errno.ENOENT
        with pytest.raises(FsError) as err:
            await stub.remove_file(3, 0, 0, 50)
        assert err.value.errno == errno.ENOENT


def routing_info(version: int, chains: dict[int, tuple[int, list[int]]]) -> RoutingInfo:
    """A routing map with one storage node holding targets 1 and 2."""
    return {
        "version": version,
        "cluster_id": "test",
        "config": {
            "chunk_size": CS,
            "stripe": 1,
            "replicas": 1,
            "min_replicas": 1,
            "heartbeat_interval": 1.0,
            "heartbeat_timeout": 5.0,
        },
        "nodes": [
            {
                "id": 1,
                "kind": "storage",
                "address": "127.0.0.1:1",
                "host": "h",
                "pid": 1,
                "state": "online",
                "last_seen": 0.0,
            }
        ],
        "targets": [
            {
                "id": t,
                "node": 1,
                "path": f"/t{t}",
                "state": "serving",
                "capacity": 1,
                "free": 1,
                "used": 0,
                "chunks": 0,
            }
            for t in (1, 2)
        ],
        "chains": [
            {"id": cid, "version": v, "targets": targets} for cid, (v, targets) in chains.items()
        ],
    }


class FakeRouting:
    def __init__(self, info: RoutingInfo) -> None:
        self.routing = Routing(info)
        self.newer: Routing | None = None
        self.refreshes = 0
        self.unreachable = False

    @property
    def current(self) -> Routing:
        return self.routing

    async def refresh(self, min_version: int | None = None) -> Routing:
        self.refreshes += 1
        if self.unreachable:
            raise FsError(errno.ECONNREFUSED, "mgmtd is down")
        if self.newer is not None:
            self.routing = self.newer
        return self.routing


async def test_writes_only_at_the_chain_head(
    nursery: trio.Nursery, stores: list[ChunkStore]
) -> None:
    routing = FakeRouting(routing_info(10, {5: (3, [1]), 6: (1, [1, 2])}))
    cid = chunk_id(60, 0)
    async with open_rpc_client(SECRET) as rpc:
        addr = await start(nursery, stores, routing=routing, rpc=rpc)
        stub = StorageStub(rpc, addr)
        assert (await stub.write(1, 5, 3, cid, 0, CS, b"one"))["version"] == 1

        async def code_of(target: int, chain: int, version: int) -> int:
            with pytest.raises(FsError) as info:
                await stub.write(target, chain, version, cid, 0, CS, b"no")
            return info.value.code

        assert await code_of(1, 5, 2) == errno.ESTALE  # the client's map is older
        assert await code_of(2, 5, 3) == errno.ESTALE  # not the head
        # chain 6 forwards to target 2, whose node (127.0.0.1:1) is unreachable:
        # a transient error, and nothing committed here
        assert await code_of(1, 6, 1) == errno.ESTALE
        assert await code_of(2, 6, 1) == errno.ESTALE  # a client never writes to a replica
        refreshed = routing.refreshes  # after a dead successor the map is refreshed
        assert refreshed == 1
        routing.unreachable = True  # newer than ours, and mgmtd cannot tell: stale
        assert await code_of(1, 5, 4) == errno.ESTALE
        routing.unreachable = False
        # the client saw a newer chain version: the server refreshes its map first
        routing.newer = Routing(routing_info(11, {5: (4, [2, 1])}))
        assert await code_of(1, 5, 4) == errno.ESTALE  # target 2 is the head now
        assert routing.refreshes == refreshed + 2
        assert await code_of(2, 77, 1) == errno.ESTALE  # a chain the daemon does not know
        _, payload = await stub.read([(1, cid, 0, 10)])
        assert payload == b"one"  # refused writes changed nothing
        assert (await stub.chunk_info(1, cid))["version"] == 1
        assert (await stub.list_chunks(2))["chunks"] == []


# ---- serve() against a fake mgmtd --------------------------------------------


class FakeMgmtd:
    def __init__(self) -> None:
        self.registrations: list[dict[str, Any]] = []
        self.heartbeats: list[list[TargetUsage]] = []
        self.unregistered: list[int] = []
        self.heartbeat_seen = trio.Event()

    def info(self) -> RoutingInfo:
        info = routing_info(1, {1: (1, [100])})
        info["targets"] = [{**t, "id": t["id"] + 99} for t in info["targets"]]
        return info

    @rpc_method
    async def register_node(
        self,
        cluster_id: str | None,
        kind: str,
        address: str,
        host: str,
        pid: int,
        node_id: int | None,
        targets: list[TargetRegistration],
    ) -> RegisterResult:
        self.registrations.append(
            {"cluster_id": cluster_id, "kind": kind, "node_id": node_id, "targets": targets}
        )
        return {
            "node_id": node_id or 7,
            "target_ids": [t["target_id"] or 100 + i for i, t in enumerate(targets)],
            "routing_version": 1,
            "cluster_id": cluster_id or "fake-cluster",
        }

    @rpc_method
    async def heartbeat(self, node_id: int, pid: int, targets: list[TargetUsage]) -> Any:
        self.heartbeats.append(targets)
        self.heartbeat_seen.set()
        return {"routing_version": 1}

    @rpc_method
    async def unregister_node(self, node_id: int) -> None:
        self.unregistered.append(node_id)

    @rpc_method
    async def get_routing(self, known_version: int = -1) -> RoutingInfo | None:
        return None if known_version == 1 else self.info()


async def test_serve_registers_persists_ids_and_unregisters(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    mgmtd = FakeMgmtd()
    port = await nursery.start(RpcServer(SECRET, [mgmtd], name="mgmtd").serve, "127.0.0.1", 0)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    config = StorageConfig(
        listen="127.0.0.1:0",
        mgmtd=f"127.0.0.1:{port}",
        data_dir=str(tmp_path / "node"),
        secret_file=str(secret_file),
        targets=[str(tmp_path / "a"), str(tmp_path / "b")],
        fsync=False,
        reserve_bytes=0,
    )
    async with trio.open_nursery() as daemon:
        storage_port = await daemon.start(functools.partial(serve, config))
        async with open_rpc_client(SECRET) as rpc:
            stub = StorageStub(rpc, f"127.0.0.1:{storage_port}")
            await stub.write(100, 1, 1, chunk_id(1, 0), 0, CS, b"hello")
            with pytest.raises(FsError) as info:  # target 101 is not chain 1's head
                await stub.write(101, 1, 1, chunk_id(1, 0), 0, CS, b"no")
            assert info.value.errno == errno.ESTALE
            with trio.fail_after(5):
                await mgmtd.heartbeat_seen.wait()
        daemon.cancel_scope.cancel()
    assert mgmtd.unregistered == [7]
    first = mgmtd.registrations[0]
    assert first["node_id"] is None and first["cluster_id"] is None and first["kind"] == "storage"
    assert [t["target_id"] for t in first["targets"]] == [None, None]
    usage = {u["target_id"]: u for u in mgmtd.heartbeats[0]}
    assert usage[100]["chunks"] == 1 and usage[100]["used"] == 5 and usage[101]["chunks"] == 0
    assert json.loads((tmp_path / "node" / "node.json").read_text()) == {
        "node_id": 7,
        "cluster_id": "fake-cluster",
    }
    assert json.loads((tmp_path / "a" / "target.json").read_text())["target_id"] == 100
    # a restart registers under the persisted ids and serves the old data
    async with trio.open_nursery() as daemon:
        storage_port = await daemon.start(functools.partial(serve, config))
        async with open_rpc_client(SECRET) as rpc:
            stub = StorageStub(rpc, f"127.0.0.1:{storage_port}")
            assert (await stub.read([(100, chunk_id(1, 0), 0, 5)]))[1] == b"hello"
        daemon.cancel_scope.cancel()
    again = mgmtd.registrations[1]
    assert again["node_id"] == 7 and again["cluster_id"] == "fake-cluster"
    assert [t["target_id"] for t in again["targets"]] == [100, 101]


def test_config_validation(tmp_path: Path) -> None:
    base = 'listen = "127.0.0.1:0"\nmgmtd = "127.0.0.1:1"\ndata_dir = "d"\nsecret_file = "s"\n'
    cases = {
        "targets = []\n": "targets",
        'targets = ["a", "a"]\n': "twice",
        'targets = ["a"]\nblock_size = 1000\n': "block size",
        'targets = ["a"]\nio_threads = 0\n': "io_threads",
        'targets = ["a"]\nfsync = "yes"\n': "fsync",
        'targets = ["a"]\nbogus = 1\n': "bogus",
        'targets = ["a"]\nforward_timeout = 0.0\n': "forward_timeout",
        'targets = ["a"]\nscrub_interval = -1.0\n': "scrub_interval",
        'targets = ["a"]\nadvertise = "no-port"\n': "advertise",
    }
    for extra, word in cases.items():
        path = tmp_path / "storage.toml"
        path.write_text(base + extra)
        with pytest.raises(FsError) as info:
            load_storage_config(path)
        assert info.value.errno == errno.EINVAL and word in info.value.strerror
    path.write_text(base + 'targets = ["a", "b"]\nfsync = false\n')
    config = load_storage_config(path)
    assert config.targets == ["a", "b"] and not config.fsync and config.block_size == 4096


async def test_bad_read_requests_get_clear_errors(
    nursery: trio.Nursery, stores: list[ChunkStore]
) -> None:
    """Oversize, negative, too many and wrongly typed read requests: an error
    naming the problem (for the request, or for the one item), and the daemon
    goes on serving the same connection."""
    addr = await start(nursery, stores)
    cid = chunk_id(5, 0)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        await stub.write(1, 0, 0, cid, 0, CS, b"still here")

        async def refused(code: int, items: Any, words: str) -> None:
            with pytest.raises(FsError) as info:
                await rpc.call(addr, "read", {"items": items})
            assert info.value.errno == code and words in info.value.message
            assert (await stub.read([(1, cid, 0, 10)]))[1] == b"still here"

        await refused(errno.EMSGSIZE, [[1, cid, 0, 1 << 40]], "reply limit")
        await refused(errno.EMSGSIZE, [[1, cid, 0, 1]] * (MAX_READ_ITEMS + 1), "items")
        await refused(errno.EINVAL, [[1, cid, True, 1]], "'items'[0][2]")
        await refused(errno.EINVAL, [[1, cid, 0, 1], [1, cid.hex(), 0, 1]], "'items'[1][1]")
        await refused(errno.EINVAL, [[1, cid, 0, 1.5]], "'items'[0][3]")
        await refused(errno.EINVAL, [1, cid, 0, 1], "'items'[0]")
        # a bad range fails its own item only
        lengths, payload = await stub.read([(1, cid, -1, 4), (1, cid, 0, -4), (1, cid, 6, 4)])
        assert lengths == [-errno.EINVAL, -errno.EINVAL, 4] and bytes(payload) == b"here"
        assert len((await stub.read([(1, cid, 0, 1)] * MAX_READ_ITEMS))[0]) == MAX_READ_ITEMS


async def test_damage_under_warm_caches_is_never_served(
    nursery: trio.Nursery, stores: list[ChunkStore]
) -> None:
    """The inline path (cached record and fd, page-cache hit) checks every
    block too: a byte flipped on disk after the caches are warm fails the
    item with EIO, and the bytes of the damaged block never leave."""
    addr = await start(nursery, stores)
    cid = chunk_id(6, 0)
    data = os.urandom(4 * 512)
    async with open_rpc_client(SECRET) as rpc:
        stub = StorageStub(rpc, addr)
        await stub.write(1, 0, 0, cid, 0, CS, data)
        for _ in range(2):  # the second read is served inline, from the caches
            assert bytes((await stub.read([(1, cid, 0, len(data))]))[1]) == data
        assert stores[0].read_nowait(cid, 0, len(data)) is not None
        path = stores[0].file_path(cid)
        assert path is not None
        flip(path, 700)  # block 1
        lengths, payload = await stub.read(
            [(1, cid, 512, 512), (1, cid, 0, 512), (1, cid, 1024, 8)]
        )
        assert lengths == [-errno.EIO, 512, 8]
        assert bytes(payload) == data[:512] + data[1024:1032]


async def test_read_sync_spreads_cold_items_over_threads_and_flags_damage(
    nursery: trio.Nursery, stores: list[ChunkStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread channel's blocking read (`read_sync`): page-cache misses of
    one request read by several threads at once, every byte as `read` gives
    it, a damaged block EIO (and nothing else of the request harmed)."""
    import threading

    service = StorageService(stores, io_threads=4)
    store = stores[0]
    blobs = {i: os.urandom(4000 + i) for i in range(12)}
    for i, blob in blobs.items():
        await service.write(1, 0, 0, chunk_id(7, i), 0, CS, blob)
    flip(store.file_path(chunk_id(7, 3)), 700)  # block 1 of chunk 3
    readers: set[str] = set()
    real_read = store.read

    def counted(*args: Any) -> memoryview:
        readers.add(threading.current_thread().name)
        return real_read(*args)

    store.read_nowait = lambda *args: None  # type: ignore[method-assign]
    store.read = counted  # type: ignore[method-assign]
    # the threads' way (without io_uring: tests/storage/test_uring.py has the ring's)
    monkeypatch.setattr("shufflefs.storage.read_service.for_this_thread", lambda: None)
    items = [(1, chunk_id(7, i), 0, 4096) for i in blobs]
    reply = await trio.to_thread.run_sync(service.read_sync, items)
    lengths = reply.result["lengths"]
    assert lengths[3] == -errno.EIO
    payload = b"".join(bytes(p) for p in reply.payload)  # type: ignore[union-attr]
    assert [n for n in lengths if n > 0] == [len(blobs[i]) for i in blobs if i != 3]
    assert payload == b"".join(blobs[i] for i in blobs if i != 3)
    assert len(readers) > 1  # not one after the other in the calling thread
