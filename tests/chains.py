"""A replicated cluster in one test process: a real mgmtd (`MgmtdService` over a
`ClusterState` and a temp `MgmtdStore`) and real storage daemons
(`StorageDaemon`, the code `shufflefs storage` runs), each behind its own
`RpcServer` on loopback. Nothing is faked: chains are built by mgmtd from the
daemons' registrations, writes travel head -> ... -> tail over rpc.

Tests reach into the daemons (their `ChunkStore`s, locks, counters) to damage
data, hold locks or stop a node, and use `ChainCluster.write` as a client
would: to the chain's head, retrying transient failures with a fresh map.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster.mgmtd import MgmtdService
from shufflefs.cluster.protocol import ClusterConfig, MgmtdStub
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.cluster.state import ClusterState
from shufflefs.cluster.store import MgmtdStore
from shufflefs.rpc import FsError, RpcClient, RpcServer
from shufflefs.storage.config import StorageConfig
from shufflefs.storage.daemon import StorageDaemon
from shufflefs.storage.protocol import ChunkInfo, StorageStub, WriteResult
from shufflefs.storage.service import StorageService
from shufflefs.storage.store import ChunkStore

SECRET = b"0123456789abcdef0123456789abcdef"
CS = 1 << 16  # chunk size of the test files
TRANSIENT = frozenset(
    {
        errno.ESTALE,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ETIMEDOUT,
        errno.ENXIO,
        errno.EAGAIN,
        errno.EHOSTDOWN,
    }
)


async def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.02)


class Node:
    def __init__(self, index: int, config: StorageConfig) -> None:
        self.index = index
        self.config = config
        self.daemon: StorageDaemon | None = None
        self.stopped = trio.Event()

    @property
    def service(self) -> StorageService:
        assert self.daemon is not None and self.daemon.service is not None
        return self.daemon.service

    def store(self, target: int) -> ChunkStore:
        return self.service._store(target)

    @property
    def target_ids(self) -> list[int]:
        return [s.target_id for s in self.service.stores if s.target_id is not None]

    @property
    def node_id(self) -> int:
        assert self.daemon is not None and self.daemon.node_id is not None
        return self.daemon.node_id


class ChainCluster:
    def __init__(
        self,
        base: Path,
        nursery: trio.Nursery,
        rpc: RpcClient,
        *,
        replicas: int = 3,
        min_replicas: int = 2,
        forward_timeout: float = 3.0,
    ) -> None:
        self.base = base
        self.nursery = nursery
        self.rpc = rpc
        self.replicas = replicas
        self.min_replicas = min_replicas
        self.forward_timeout = forward_timeout
        self.nodes: list[Node] = []
        self.secret_file = base / "secret"
        self.secret_file.write_bytes(SECRET)
        self.secret_file.chmod(0o600)
        self.mgmtd_address = ""
        self.state: ClusterState | None = None
        self.routing = RoutingCache(rpc, "")

    async def start_mgmtd(self) -> None:
        config = ClusterConfig(
            chunk_size=CS,
            stripe=4,
            replicas=self.replicas,
            min_replicas=self.min_replicas,
            heartbeat_interval=1.0,
            heartbeat_timeout=60.0,  # nodes leave by a clean stop or a verified report only
        )
        self.state = ClusterState.new(config)
        store = MgmtdStore(self.base / "mgmtd")
        service = MgmtdService(self.state, store, self.rpc)
        port = await self.nursery.start(
            RpcServer(SECRET, [service], name="mgmtd").serve, "127.0.0.1", 0
        )
        self.mgmtd_address = f"127.0.0.1:{port}"
        self.state.register_self(self.mgmtd_address, "localhost", os.getpid(), time.time())
        self.nursery.start_soon(service.watch_heartbeats)
        self.routing = RoutingCache(self.rpc, self.mgmtd_address)
        self.mgmtd = MgmtdStub(self.rpc, self.mgmtd_address)

    def add_node(self, targets: int = 1, **overrides: Any) -> Node:
        index = len(self.nodes) + 1
        node_dir = self.base / f"node{index}"
        config = StorageConfig(
            listen="127.0.0.1:0",
            mgmtd=self.mgmtd_address,
            data_dir=str(node_dir),
            secret_file=str(self.secret_file),
            targets=[str(node_dir / f"t{i}") for i in range(targets)],
            fsync=False,
            reserve_bytes=0,
            block_size=512,
            io_threads=4,
            forward_timeout=self.forward_timeout,
            **overrides,
        )
        node = Node(index, config)
        self.nodes.append(node)
        return node

    async def start_node(self, node: Node) -> None:
        """Start (or restart) a node's daemon and wait until it registered."""
        node.daemon = StorageDaemon(node.config)
        node.stopped = trio.Event()
        daemon, stopped = node.daemon, node.stopped

        async def run(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await daemon.run(task_status=task_status)
            finally:
                stopped.set()

        await self.nursery.start(run)

    async def stop_node(self, node: Node, *, clean: bool = True) -> None:
        """Stop a node's daemon; ``clean=False`` as if it crashed (mgmtd is not told)."""
        assert node.daemon is not None
        node.daemon.stop(clean=clean)
        with trio.fail_after(10):
            await node.stopped.wait()

    async def start(self, nodes: int = 3, targets: int = 1, **overrides: Any) -> None:
        """mgmtd and *nodes* storage daemons (*overrides*: StorageConfig fields)."""
        await self.start_mgmtd()
        for _ in range(nodes):
            await self.start_node(self.add_node(targets, **overrides))
        await self.sync_maps()

    async def sync_maps(self) -> Routing:
        """Make every running daemon (and the test) see mgmtd's current map
        (they would within a second or two anyway: heartbeat replies, polls)."""
        routing = await self.routing.refresh()
        for node in self.nodes:
            if (
                node.daemon is not None
                and node.daemon.routing is not None
                and not node.stopped.is_set()
            ):
                await node.daemon.routing.refresh()
        return routing

    # ---- as a client would ------------------------------------------------

    def node_of(self, target: int) -> Node:
        for node in self.nodes:
            if node.daemon is not None and not node.stopped.is_set() and target in node.target_ids:
                return node
        raise KeyError(target)

    def stub_for(self, target: int, timeout: float = 30.0) -> StorageStub:
        return StorageStub(self.rpc, self.routing.current.target_address(target), timeout=timeout)

    def chain_ids(self) -> list[int]:
        return sorted(self.routing.current.chains)

    def members(self, chain: int) -> list[int]:
        return [t["id"] for t in self.routing.current.write_targets(chain)]

    async def write(
        self, chain: int, cid: bytes, offset: int, data: bytes, *, budget: float = 30.0
    ) -> WriteResult:
        """Write through the chain's head, retrying transient failures (as the
        client library does)."""
        deadline = trio.current_time() + budget
        while True:
            routing = await self.routing.refresh()
            info = routing.chain(chain)
            serving = routing.serving_targets(chain)
            try:
                if not serving:
                    raise FsError(errno.ENXIO, f"chain {chain} has no serving target")
                head = serving[0]["id"]
                return await self.stub_for(head).write(
                    head, chain, info["version"], cid, offset, CS, data
                )
            except FsError as exc:
                if exc.code not in TRANSIENT or trio.current_time() > deadline:
                    raise
                await trio.sleep(0.05)

    async def file_op(self, chain: int, ino: int, size: int | None, *, budget: float = 30.0) -> int:
        """truncate_file (size given) or remove_file at the chain's head."""
        deadline = trio.current_time() + budget
        while True:
            routing = await self.routing.refresh()
            info = routing.chain(chain)
            head = routing.serving_targets(chain)[0]["id"]
            stub = self.stub_for(head)
            try:
                if size is None:
                    return await stub.remove_file(head, chain, info["version"], ino)
                return await stub.truncate_file(head, chain, info["version"], ino, size, CS)
            except FsError as exc:
                if exc.code not in TRANSIENT or trio.current_time() > deadline:
                    raise
                await trio.sleep(0.05)

    async def replica_state(self, target: int) -> dict[bytes, tuple[int, int, bytes]]:
        """(version, length, crcs) of every chunk a target holds."""
        out: dict[bytes, tuple[int, int, bytes]] = {}
        after: bytes | None = None
        stub = self.stub_for(target)
        while True:
            page = await stub.list_chunks(target, after, 1000)
            for info in page["chunks"]:
                out[info["chunk"]] = (info["version"], info["length"], info["crcs"])
            if not page["more"]:
                return out
            after = page["chunks"][-1]["chunk"]

    async def read_all(self, target: int, cids: list[bytes]) -> dict[bytes, bytes]:
        """The bytes of each chunk as *target* serves them (verified)."""
        stub = self.stub_for(target)
        lengths, payload = await stub.read([(target, c, 0, CS) for c in cids])
        out, pos = {}, 0
        for cid, n in zip(cids, lengths, strict=True):
            assert n >= 0, f"reading {cid.hex()} from target {target}: errno {-n}"
            out[cid] = bytes(payload[pos : pos + n])
            pos += n
        return out

    async def assert_identical(
        self, chain: int, cids: list[bytes] | None = None
    ) -> dict[bytes, tuple[int, int, bytes]]:
        """Every write target of the chain holds the same chunks, at the same
        versions with the same checksums, and serves the same bytes."""
        members = self.members(chain)
        states = [await self.replica_state(t) for t in members]
        for target, state in zip(members[1:], states[1:], strict=True):
            assert state == states[0], (
                f"target {target} differs from the head {members[0]}: "
                + ", ".join(
                    f"{c.hex()}: {state.get(c, (None,))[:2]} vs {states[0].get(c, (None,))[:2]}"
                    for c in sorted(set(state) | set(states[0]))
                    if state.get(c) != states[0].get(c)
                )
            )
        wanted = cids if cids is not None else sorted(states[0])
        contents = [await self.read_all(t, wanted) for t in members]
        for target, content in zip(members[1:], contents[1:], strict=True):
            assert content == contents[0], f"target {target} serves other bytes than the head"
        return states[0]

    async def info(self, target: int, cid: bytes) -> ChunkInfo | None:
        try:
            return await self.stub_for(target).chunk_info(target, cid)
        except FsError as exc:
            if exc.code == errno.ENOENT:
                return None
            raise

    def write_client_config(self) -> Path:
        path = self.base / "client.toml"
        path.write_text(f'mgmtd = "{self.mgmtd_address}"\nsecret_file = "{self.secret_file}"\n')
        return path
