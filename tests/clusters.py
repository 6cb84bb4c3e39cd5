"""Every way a test starts a cluster. Each runs the real services' code; the
fixtures are registered in conftest.py.

In one process, for the unit layer (no root, no FUSE, no child processes):

- `cluster` (async fixture): a `ChainCluster` with a real mgmtd and three
  storage daemons, each behind its own `RpcServer` on loopback in the test's
  trio nursery; `ChainCluster.start_meta()` adds a metadata server. Tests
  reach into the daemons (their `ChunkStore`s, locks, counters) to damage
  data, hold locks or stop a node, and use `ChainCluster.write` as a client
  would: to the chain's head, retrying transient failures with a fresh map.

As real processes, started by the real launcher (`shufflefs up`), marked e2e:

- `mounted` (session): one `ProcessCluster` (mgmtd, metadata server, three
  storage daemons, a FUSE mount) shared by every test; `mnt` is a fresh
  directory in it per test, `native` a `shufflefs.client.Client` on it.
- `process_cluster`: a formatted `ProcessCluster` of its own, not started:
  the test starts, kills and restarts services (`start`, `kill`, `up`).
- `fault_cluster`: a `ProcessCluster` with replicas 3, fast heartbeats and
  each storage daemon on its own network-namespace host (tests/hosts.py),
  mounted; where namespaces cannot be made, on loopback (and says so).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from harness import shufflefs
from hosts import TestHosts, namespaces_available

from shufflefs.cluster import procs
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.coordination import EmbeddedCoordination
from shufflefs.cluster.launcher import LocalCluster, default_replicas
from shufflefs.cluster.mgmtd import MgmtdService
from shufflefs.cluster.protocol import ClusterConfig, MgmtdStub, RoutingInfo
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.cluster.startup import wait_services_ready
from shufflefs.cluster.state import ClusterState
from shufflefs.metadata.config import MetaConfig
from shufflefs.metadata.process import serve as serve_meta
from shufflefs.rpc import FsError, RpcClient, RpcServer, open_rpc_client
from shufflefs.rpc.retry import Backoff, retrying
from shufflefs.storage.config import StorageConfig
from shufflefs.storage.daemon import StorageDaemon
from shufflefs.storage.layout import CHUNKS_DIR, chunk_dir_name
from shufflefs.storage.protocol import ChunkInfo, StorageStub, WriteResult
from shufflefs.storage.service import StorageService
from shufflefs.storage.store import ChunkStore

T = TypeVar("T")

SECRET = b"0123456789abcdef0123456789abcdef"
CS = 1 << 16  # chunk size of the test files


async def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.02)


def wait_until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll *check* (outside trio: tests driving processes) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def files_landed(top: Path) -> int:
    """Entries in the directories under *top* (0 while it does not exist):
    how far a copy of a tree of one level of directories has got."""
    try:
        return sum(len(os.listdir(top / d)) for d in os.listdir(top))
    except FileNotFoundError:
        return 0


def chunk_files(data_dir: Path, ino: int) -> list[Path]:
    """The chunk files of inode *ino* on every storage target of a local
    cluster (their names start with the chunk id: the inode as 16 hex
    digits, then the index)."""
    return sorted(data_dir.glob(f"storage*/target*/chunks/*/{ino:016x}*"))


def mount_pid(cluster: ProcessCluster, mountpoint: Path) -> int:
    """The pid of the process serving *mountpoint* (``shufflefs status``)."""
    out = shufflefs("status", "--json", "--config", str(cluster.client_config)).stdout
    return int(
        next(m["pid"] for m in json.loads(out)["mounts"] if m["mountpoint"] == str(mountpoint))
    )


def chain_places(cluster: ProcessCluster, path: str, files: list[Path]) -> dict[Path, int]:
    """Each of *files* (chunk files of *path*, a path in the cluster's
    namespace) with its target's place in its chunk's chain (0: the head,
    which a reader on this host reads from its chunk files)."""
    info = json.loads(
        shufflefs("info", "--json", "--config", str(cluster.client_config), path).stdout
    )
    place = {
        (c["chunk"], r["target"]): k for c in info["chunks"] for k, r in enumerate(c["replicas"])
    }
    return {
        f: place[(f.name[:24], json.loads((f.parents[2] / "target.json").read_text())["target_id"])]
        for f in files
    }


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
        return self.service.node.store(target)

    def service_calls(self, method: str) -> int:
        """Calls of *method* this node's rpc server answered (loop and channels)."""
        assert self.daemon is not None and self.daemon.server is not None
        server = self.daemon.server
        on_channels = server.channels.calls[method] if server.channels is not None else 0
        return server.builtin.calls[method] + on_channels

    @property
    def target_ids(self) -> list[int]:
        return [s.target_id for s in self.service.node.stores if s.target_id is not None]

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
        coordination = EmbeddedCoordination(self.base / "mgmtd")
        coordination.elected.set()
        service = MgmtdService(self.state, coordination, self.rpc)
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

    async def start_meta(self) -> str:
        """A metadata server (the code `shufflefs meta` runs) joined to this
        cluster; returns its address. It runs until the cluster's nursery ends."""
        config = MetaConfig(
            listen="127.0.0.1:0",
            mgmtd=self.mgmtd_address,
            data_dir=str(self.base / "meta"),
            secret_file=str(self.secret_file),
            sync=False,
            map_size=64 << 20,
        )
        address: str = await self.nursery.start(functools.partial(serve_meta, config))
        await self.sync_maps()
        return address

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

    def chunk_file(self, target: int, cid: bytes) -> Path:
        """The committed file of chunk *cid* on *target* (to damage it)."""
        folder = self.node_of(target).store(target).path / CHUNKS_DIR / chunk_dir_name(cid)
        (found,) = [p for p in folder.iterdir() if p.name.startswith(cid.hex())]
        return found

    def stub_for(self, target: int, timeout: float = 30.0) -> StorageStub:
        return StorageStub(self.rpc, self.routing.current.target_address(target), timeout=timeout)

    def chain_ids(self) -> list[int]:
        return sorted(self.routing.current.chains)

    def members(self, chain: int) -> list[int]:
        return [t["id"] for t in self.routing.current.write_targets(chain)]

    async def write(
        self, chain: int, cid: bytes, offset: int, data: bytes, *, budget: float = 30.0
    ) -> WriteResult:
        """Write through the chain's head, retrying transient failures with a
        fresh map (as the client library does)."""

        async def attempt() -> WriteResult:
            routing = await self.routing.refresh()
            info = routing.chain(chain)
            serving = routing.serving_targets(chain)
            if not serving:
                raise FsError(errno.ENXIO, f"chain {chain} has no serving target")
            head = serving[0]["id"]
            return await self.stub_for(head).write(
                head, chain, info["version"], cid, offset, CS, data
            )

        return await self._at_head(f"write to chain {chain}", attempt, budget)

    async def file_op(self, chain: int, ino: int, size: int | None, *, budget: float = 30.0) -> int:
        """truncate_file (size given) or remove_file at the chain's head."""

        async def attempt() -> int:
            routing = await self.routing.refresh()
            info = routing.chain(chain)
            head = routing.serving_targets(chain)[0]["id"]
            stub = self.stub_for(head)
            if size is None:
                return await stub.remove_file(head, chain, info["version"], ino)
            return await stub.truncate_file(head, chain, info["version"], ino, size, CS)

        return await self._at_head(f"file op on chain {chain}", attempt, budget)

    @staticmethod
    async def _at_head(what: str, attempt: Callable[[], Awaitable[T]], budget: float) -> T:
        return await retrying(what, attempt, budget=budget, backoff=Backoff(first=0.05, cap=0.05))

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


# ---- real processes ------------------------------------------------------------

HEARTBEAT_FAST = {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0}


class ProcessCluster:
    """A local cluster of real service processes, formatted under *data_dir*
    and run by the real launcher (`shufflefs up`/`down`; the services are
    stopped by pid). With *hosts*, each storage daemon runs on its own
    network-namespace host (tests/hosts.py) and mgmtd, the metadata server
    and the mount on the bridge address."""

    def __init__(
        self,
        data_dir: Path,
        mountpoint: Path | None = None,
        *,
        storage_nodes: int = 3,
        replicas: int | None = None,
        chunk_size: int = 1 << 20,
        hosts: TestHosts | None = None,
        mgmtd_settings: dict[str, Any] | None = None,
        meta_servers: int = 1,
        meta_hosts: TestHosts | None = None,
        targets_per_node: int = 1,
        ha: bool = False,
    ) -> None:
        """*meta_hosts*: each metadata server on its own network-namespace
        host (storage daemons and mgmtd on the bridge address). *ha*: as
        `up --ha` (3 etcd members, 3 mgmtd; *meta_servers* at least 3)."""
        self.local = LocalCluster(data_dir)
        self.mountpoint = mountpoint or self.local.dir.parent / "mnt"
        self.hosts = hosts
        if not self.local.exists():
            nodes = range(1, storage_nodes + 1)
            metas = range(1, meta_servers + 1)
            self.local.format(
                storage_nodes,
                default_replicas(storage_nodes, replicas),
                chunk_size,
                hosts.gateway if hosts else meta_hosts.gateway if meta_hosts else "127.0.0.1",
                storage_hosts=[hosts.address(i) for i in nodes] if hosts else None,
                storage_netns=[hosts.netns(i) for i in nodes] if hosts else None,
                mgmtd_settings=mgmtd_settings,
                meta_servers=meta_servers,
                meta_hosts=[meta_hosts.address(i) for i in metas] if meta_hosts else None,
                meta_netns=[meta_hosts.netns(i) for i in metas] if meta_hosts else None,
                targets_per_node=targets_per_node,
                ha=ha,
            )
        self.layout = self.local.layout()
        self.mgmtd_address = self.layout.mgmtd_address  # HA: every instance, a,b,c

    @property
    def data_dir(self) -> Path:
        return self.local.dir

    @property
    def client_config(self) -> Path:
        return self.local.client_config

    config = client_config

    # ---- the launcher, as an operator runs it --------------------------------

    def up(self, *, mount: bool = True) -> None:
        """`shufflefs up`: start whatever is not running, and mount."""
        where = ["--mountpoint", str(self.mountpoint)] if mount else ["--no-mount"]
        shufflefs("up", "--data-dir", str(self.data_dir), *where)

    def restart_missing(self) -> None:
        """What an operator does after a crash: `shufflefs up` again (the
        mount, still running, is left alone)."""
        self.up(mount=False)

    def down(self, *, check: bool = False) -> None:
        """`shufflefs down`: unmount, stop every service."""
        shufflefs("down", "--data-dir", str(self.data_dir), check=check)

    @contextmanager
    def running(self, *, serving: bool = True) -> Iterator[ProcessCluster]:
        """Up (and, unless told, every target serving) for the `with`, then
        down, also when starting failed halfway."""
        try:
            self.up()
            if serving:
                self.all_serving()
            yield self
        finally:
            self.down()

    # ---- single services ---------------------------------------------------------

    def service(self, name: str) -> procs.ServiceProcess:
        return next(s for s in self.local.services() if s.name == name)

    def names(self) -> list[str]:
        return [s.name for s in self.local.services()]

    def start(self, *names: str, wait: bool = True) -> dict[str, int]:
        """Start these services (default: all) if not running; with *wait*,
        until they are registered and ready as `shufflefs up` waits."""
        pids = {}
        for name in names or self.names():
            svc = self.service(name)
            pids[name] = procs.running_pid(svc) or procs.start(svc)
        if wait:
            ready = {n: p for n, p in pids.items() if n != "mgmtd"}
            trio.run(wait_services_ready, self.local, ready, 60.0)
        return pids

    def pid(self, name: str) -> int | None:
        return procs.running_pid(self.service(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pid(name)
        assert pid is not None, f"{name} is not running"
        procs.signal_pid(pid, sig)
        assert procs.wait_exit(pid, 15.0), f"{name} did not exit"

    def stop_all(self) -> None:
        for svc in reversed(self.local.services()):
            procs.stop(svc)

    def log(self, name: str) -> str:
        return (self.local.logs / f"{name}.log").read_text(errors="replace")

    # ---- talking to it -------------------------------------------------------------

    def secret(self) -> bytes:
        return load_client_config(self.client_config)[1]

    @asynccontextmanager
    async def rpc(self) -> AsyncIterator[RpcClient]:
        async with open_rpc_client(self.secret()) as rpc:
            yield rpc

    def meta_calls(self) -> dict[str, int]:
        """The metadata server's requests served so far, per method (`rpc_calls`)."""
        address = Routing(self.routing()).meta_address()

        async def fetch() -> dict[str, int]:
            async with self.rpc() as rpc:
                result: dict[str, int] = await rpc.call(address, "rpc_calls", {}, timeout=5.0)
                return result

        return trio.run(fetch)

    def routing(self) -> RoutingInfo:
        async def fetch() -> RoutingInfo:
            async with self.rpc() as rpc:
                return await MgmtdStub(rpc, self.mgmtd_address).status()

        return trio.run(fetch)

    def status(self) -> dict[str, Any]:
        out = shufflefs("status", "--json", "--config", str(self.client_config)).stdout
        result: dict[str, Any] = json.loads(out)
        return result

    def storage_node_of(self, name: str) -> int:
        """mgmtd's node id of storage daemon *name* (by its pid)."""
        pid = self.pid(name)
        for n in self.status()["nodes"]:
            if n["pid"] == pid:
                return int(n["id"])
        raise AssertionError(f"{name} (pid {pid}) not registered")

    def wait_for(self, what: str, predicate: Any, timeout: float = 60.0) -> float:
        """Poll the status until *predicate(status)*; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            status = self.status()
            if predicate(status):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}: {json.dumps(status)[:2000]}")
            time.sleep(0.2)

    def all_serving(self) -> float:
        return self.wait_for(
            "every target serving",
            lambda s: all(t["state"] == "serving" for t in s["targets"]),
        )


@contextmanager
def another_mount(cluster: ProcessCluster, mountpoint: Path, options: str = "") -> Iterator[Path]:
    """A second mount of *cluster* (the real `shufflefs mount`, with `-o`
    *options* if given), removed with `shufflefs umount`."""
    given = ["-o", options] if options else []
    shufflefs("mount", "--config", str(cluster.client_config), *given, str(mountpoint))
    try:
        yield mountpoint
    finally:
        shufflefs("umount", str(mountpoint))


# ---- comparing replicas ------------------------------------------------------------


def replica_states(cluster: ProcessCluster) -> dict[int, list[dict[bytes, tuple[int, int, bytes]]]]:
    """For every chain, each member's chunks: id -> (version, length, CRCs)."""
    routing = cluster.routing()
    _, secret = load_client_config(cluster.client_config)
    nodes = {n["id"]: n for n in routing["nodes"]}
    targets = {t["id"]: t for t in routing["targets"]}

    async def listing(stub: StorageStub, target: int) -> dict[bytes, tuple[int, int, bytes]]:
        chunks: dict[bytes, tuple[int, int, bytes]] = {}
        after: bytes | None = None
        while True:
            page = await stub.list_chunks(target, after, 1000)
            for c in page["chunks"]:
                info: ChunkInfo = c
                chunks[info["chunk"]] = (info["version"], info["length"], info["crcs"])
            if not page["more"] or not page["chunks"]:
                return chunks
            after = page["chunks"][-1]["chunk"]

    async def collect() -> dict[int, list[dict[bytes, tuple[int, int, bytes]]]]:
        out: dict[int, list[dict[bytes, tuple[int, int, bytes]]]] = {}
        async with open_rpc_client(secret) as rpc:
            for chain in routing["chains"]:
                members = []
                for t in chain["targets"]:
                    address = nodes[targets[t]["node"]]["address"]
                    members.append(await listing(StorageStub(rpc, address), t))
                out[chain["id"]] = members
        return out

    return trio.run(collect)


def assert_replicas_identical(cluster: ProcessCluster) -> int:
    """Every chunk has the same version, length and CRCs on every replica."""
    states = replica_states(cluster)
    total = 0
    for chain, members in states.items():
        first = members[0]
        for other in members[1:]:
            assert other.keys() == first.keys(), f"chain {chain}: replicas hold different chunks"
            for cid, state in first.items():
                assert other[cid] == state, f"chain {chain}: chunk {cid.hex()} differs"
        total += len(first)
    return total


# ---- fixtures (registered in conftest.py) ------------------------------------------


def require_fuse() -> None:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.fail("end-to-end tests need root and /dev/fuse (run via `make test` as root)")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ChainCluster]:
    """Three storage daemons and a real mgmtd in this process (`ChainCluster`)."""
    async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
        c = ChainCluster(tmp_path, nursery, rpc)
        await c.start(nodes=3)
        yield c
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="session")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    """One mounted cluster of real processes for the whole session."""
    require_fuse()
    base = tmp_path_factory.mktemp("cluster")
    c = ProcessCluster(base / "data", base / "mnt")
    c.up()
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def mnt(mounted: ProcessCluster, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory inside the shared mount, for one test."""
    d = mounted.mountpoint / request.node.name.replace("/", "_")[:100]
    d.mkdir()
    yield d


@pytest.fixture(scope="session")
def writeback_mount(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A second mount of the session's cluster, ``-o writeback`` (closes of
    written files finish behind: fuse/writeback.py)."""
    mountpoint = tmp_path_factory.mktemp("writeback-mount")
    shufflefs("mount", "--config", str(mounted.client_config), "-o", "writeback", str(mountpoint))
    try:
        yield mountpoint
    finally:
        shufflefs("umount", str(mountpoint))


@pytest.fixture(scope="session")
def writeback_cache_mount(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Another mount of the session's cluster, ``-o writeback,writeback_cache``
    (the kernel's writeback cache too: write(2)s gather in its page cache)."""
    mountpoint = tmp_path_factory.mktemp("writeback-cache-mount")
    options = "writeback,writeback_cache"
    shufflefs("mount", "--config", str(mounted.client_config), "-o", options, str(mountpoint))
    try:
        yield mountpoint
    finally:
        shufflefs("umount", str(mountpoint))


def mount_metrics_url(cluster: ProcessCluster, mountpoint: Path) -> str:
    """The Prometheus URL of the mount process serving *mountpoint* (as
    `shufflefs status --json` lists it: its client name holds its pid)."""
    from shufflefs.fuse.mount import mount_processes

    [pid] = mount_processes(mountpoint)
    status = json.loads(
        shufflefs("status", "--json", "--config", str(cluster.client_config)).stdout
    )
    urls = [c["metrics"] for c in status["clients"] if f":{pid}:" in c["name"]]
    assert len(urls) == 1 and urls[0], status["clients"]
    return str(urls[0])


@pytest.fixture(params=["rw", "writeback", "writeback_cache"])
def writable_mnt(request: pytest.FixtureRequest, mnt: Path) -> Path:
    """The test's directory (`mnt`) through each mount mode that writes:
    the default mount, a ``-o writeback`` one, and one with the kernel's
    writeback cache as well."""
    if request.param != "rw":
        return Path(request.getfixturevalue(f"{request.param}_mount")) / mnt.name
    return mnt


@pytest.fixture
def native(mounted: ProcessCluster) -> Iterator[object]:
    from shufflefs.client import Client

    with Client(mounted.client_config) as c:
        yield c


@pytest.fixture
def process_cluster(tmp_path: Path) -> Iterator[ProcessCluster]:
    """A formatted one-storage-node cluster the test starts and kills itself."""
    c = ProcessCluster(tmp_path / "c", storage_nodes=1)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def fault_cluster(tmp_path: Path) -> Iterator[ProcessCluster]:
    """Replicas 3, storage nodes on their own hosts, fast heartbeats (a node
    is declared dead after 3 s), mounted and every target serving."""
    why_not = namespaces_available()
    hosts: TestHosts | None = None
    if why_not is None:
        hosts = TestHosts(3)
        hosts.create()
    else:
        print(f"NOTE: network namespaces unavailable ({why_not}); storage nodes on loopback")
    c: ProcessCluster | None = None
    try:
        c = ProcessCluster(
            tmp_path / "data",
            tmp_path / "mnt",
            replicas=3,
            hosts=hosts,
            mgmtd_settings=HEARTBEAT_FAST,
        )
        c.up()
        c.all_serving()
        yield c
    finally:
        if c is not None:
            c.down()
        if hosts is not None:
            hosts.destroy()


@contextmanager
def storage_stopped(cluster: ProcessCluster, *also: str) -> Iterator[None]:
    """Every storage daemon SIGSTOPped (briefly: well under mgmtd's heartbeat
    timeout), so nothing that reaches storage completes; and the
    services whose names start with one of *also*."""
    kinds = ("storage", *also)
    pids = [p for n in cluster.names() if n.startswith(kinds) and (p := cluster.pid(n))]
    assert len(pids) > len(also)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
