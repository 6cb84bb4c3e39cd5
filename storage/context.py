"""`NodeContext`: what every role of one storage node shares.

The rpc handlers (`service.py`), forwarding, repair, scrub and resync all
work on the same targets, take the same locks and run their disk work on the
same bounded pool of worker threads. They reach the rest of the cluster
through the same routing map, rpc client and mgmtd stub, which the daemon
fills in once it has them (`daemon.py`): without them (unit tests of a lone
target) writes apply locally and nothing is copied between replicas.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import trio

from shufflefs.cluster.protocol import MgmtdStub, TargetInfo
from shufflefs.cluster.routing import Routing
from shufflefs.rpc import FsError, RpcClient
from shufflefs.storage.chain import LockTable, chain_of
from shufflefs.storage.protocol import ChunkMeta, StorageStub
from shufflefs.storage.store import ChunkStore
from shufflefs.storage.update_queue import UpdateQueue

T = TypeVar("T")

COPY_TIMEOUT = 60.0  # read_chunk / list_chunks calls of resync, repair and scrub


async def read_copy(
    stub: StorageStub, target: int, cid: bytes
) -> tuple[ChunkMeta | None, bytearray]:
    """*target*'s whole committed copy of a chunk (`read_chunk`: verified
    there, under its chunk lock), or ``(None, empty)`` if it holds none."""
    try:
        return await stub.read_chunk(target, cid)
    except FsError as exc:
        if exc.code != errno.ENOENT:
            raise
        return None, bytearray()


class RoutingSource(Protocol):
    """What a storage node needs of the routing map (a `RoutingCache`)."""

    @property
    def current(self) -> Routing: ...

    async def refresh(self, min_version: int | None = None) -> Routing: ...


class NodeContext:
    """This node's targets (by id once mgmtd assigned ids), the worker-thread
    limiter for disk work, the locks that order updates, and the links to
    the cluster."""

    def __init__(
        self,
        stores: Sequence[ChunkStore],
        *,
        io_threads: int = 16,
        routing: RoutingSource | None = None,
        rpc: RpcClient | None = None,
        mgmtd: MgmtdStub | None = None,
        node_id: int | None = None,
    ) -> None:
        self.stores = list(stores)
        self.io_threads = max(1, io_threads)
        self.limiter = trio.CapacityLimiter(self.io_threads)
        self.locks = LockTable()
        self.routing = routing
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.node_id = node_id
        self.by_id: dict[int, ChunkStore] = {}
        self._updates: dict[ChunkStore, UpdateQueue] = {}
        self.reindex()
        # for work a thread channel's I/O thread hands back to the loop
        self.trio_token: trio.lowlevel.TrioToken | None = None
        # the loop's thread (None outside a trio run): the one where nothing may wait
        self.loop_thread: int | None = None
        with contextlib.suppress(RuntimeError):  # built outside a trio run (a unit test)
            self.trio_token = trio.lowlevel.current_trio_token()
            self.loop_thread = threading.get_ident()

    def reindex(self) -> None:
        """Rebuild the target id index (after mgmtd assigned ids)."""
        self.by_id = {s.target_id: s for s in self.stores if s.target_id is not None}

    def store(self, target: int) -> ChunkStore:
        store = self.by_id.get(target)
        if store is None:
            raise FsError(errno.ENOENT, f"target {target} is not on this storage node")
        return store

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking disk work in a worker thread (never on the event loop)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def updates(self, store: ChunkStore) -> UpdateQueue:
        """*store*'s update queue: the steps of its chunk updates, batched
        into one worker-thread call each (`storage/update_queue.py`)."""
        queue = self._updates.get(store)
        if queue is None:
            queue = self._updates[store] = UpdateQueue(store, self.io)
        return queue

    # ---- other replicas ----------------------------------------------------

    def routing_now(self) -> Routing | None:
        if self.routing is None:
            return None
        try:
            return self.routing.current
        except FsError:
            return None

    def readable(self, target: int) -> bool:
        """May *target* answer a read? Only while our routing map shows it
        serving. A syncing target (back from the dead, still catching up),
        one mgmtd took offline or out of its chain may hold stale bytes, and
        a client whose map is older than ours would read them: it is sent
        elsewhere (ESTALE) and refreshes its map. A lone target (no mgmtd)
        is its own authority."""
        if self.routing is None:
            return True
        routing = self.routing_now()
        return routing is not None and target in routing.serving_ids

    def other_serving(self, target: int) -> list[TargetInfo]:
        """The serving replicas of *target*'s chain other than it, head first."""
        routing = self.routing_now()
        chain = chain_of(routing, target) if routing is not None else None
        if routing is None or chain is None:
            return []
        return [t for t in routing.serving_targets(chain["id"]) if t["id"] != target]

    def stub_for(self, target: int, routing: Routing | None = None) -> StorageStub:
        """A stub to the node holding *target*, for copies between replicas."""
        routing = routing or self.routing_now()
        if routing is None or self.rpc is None:
            raise FsError(errno.EHOSTDOWN, "no routing map or rpc client to reach other replicas")
        return StorageStub(self.rpc, routing.target_address(target), timeout=COPY_TIMEOUT)

    async def fetch(self, source: TargetInfo, cid: bytes) -> tuple[ChunkMeta, bytearray]:
        """Another replica's whole committed copy of a chunk, verified there."""
        return await self.stub_for(source["id"]).read_chunk(source["id"], cid)

    async def install(
        self, store: ChunkStore, cid: bytes, data: bytes | bytearray, chunk_size: int, version: int
    ) -> None:
        """Replace our copy of a chunk with another replica's (the caller holds
        the chunk's lock): staged, flushed and committed with the other
        updates of the target that arrive meanwhile (one thread call, their
        flushes shared: storage/update_queue.py)."""
        stage = partial(store.stage_replace, cid, data, chunk_size, version, False)
        await self.updates(store).write(cid, stage)
