"""The routing map as clients and servers see it, and the cache that keeps it fresh.

`Routing` is an immutable snapshot with indexes (chain -> targets -> node
address). `RoutingCache` fetches it from mgmtd, polls for a newer version in
the background, and refreshes at once when a caller learns the map is stale
(a heartbeat reply with a higher version, a dead peer, a stale chain version).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections.abc import Callable, Iterator

import trio

from shufflefs.cluster.protocol import (
    ChainInfo,
    ClusterConfig,
    MgmtdStub,
    NodeInfo,
    RoutingInfo,
    TargetInfo,
)
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import Backoff

log = logging.getLogger("shufflefs.routing")


class Routing:
    """One version of the routing map."""

    def __init__(self, info: RoutingInfo) -> None:
        self.info = info
        self.version: int = info["version"]
        self.cluster_id: str = info["cluster_id"]
        self.config: ClusterConfig = info["config"]
        self.nodes: dict[int, NodeInfo] = {n["id"]: n for n in info["nodes"]}
        self.targets: dict[int, TargetInfo] = {t["id"]: t for t in info["targets"]}
        self.chains: dict[int, ChainInfo] = {c["id"]: c for c in info["chains"]}

    def node_of_target(self, target_id: int) -> NodeInfo:
        target = self.targets.get(target_id)
        if target is None:
            raise FsError(errno.ENXIO, f"unknown storage target {target_id}")
        node = self.nodes.get(target["node"])
        if node is None:
            raise FsError(errno.ENXIO, f"target {target_id} is on unknown node {target['node']}")
        return node

    def target_address(self, target_id: int) -> str:
        return self.node_of_target(target_id)["address"]

    def chain(self, chain_id: int) -> ChainInfo:
        chain = self.chains.get(chain_id)
        if chain is None:
            raise FsError(errno.ENXIO, f"unknown chain {chain_id}")
        return chain

    def serving_targets(self, chain_id: int) -> list[TargetInfo]:
        """The chain's targets that serve reads and writes, head first."""
        return [
            self.targets[t]
            for t in self.chain(chain_id)["targets"]
            if t in self.targets and self.targets[t]["state"] == "serving"
        ]

    @functools.cached_property
    def serving_ids(self) -> frozenset[int]:
        """Every target that serves reads: serving, in a chain."""
        return frozenset(
            t
            for c in self.chains.values()
            for t in c["targets"]
            if t in self.targets and self.targets[t]["state"] == "serving"
        )

    def all_chain_targets(self, chain_id: int) -> list[TargetInfo]:
        return [self.targets[t] for t in self.chain(chain_id)["targets"] if t in self.targets]

    def write_targets(self, chain_id: int) -> list[TargetInfo]:
        """Where a write to the chain goes, in order: the serving targets
        (head first), then the syncing ones, which must see every new write."""
        return [t for t in self.all_chain_targets(chain_id) if t["state"] in ("serving", "syncing")]

    def writable_chains(self) -> list[int]:
        """Chains new files are laid out on: every member serving and none out
        of space; if there are none such, chains with at least `min_replicas`
        serving members and space left (a degraded cluster still takes files)."""
        healthy, degraded = [], []
        minimum = self.config["min_replicas"]
        for c in self.chains.values():
            members = [self.targets.get(t) for t in c["targets"]]
            serving = [m for m in members if m is not None and m["state"] == "serving"]
            if not serving or any(m["free"] <= 0 for m in serving):
                continue
            if len(serving) == len(members):
                healthy.append(c["id"])
            elif len(serving) >= minimum:
                degraded.append(c["id"])
        return sorted(healthy or degraded)

    def nodes_of_kind(self, kind: str, online_only: bool = True) -> list[NodeInfo]:
        return sorted(
            (
                n
                for n in self.nodes.values()
                if n["kind"] == kind and (n["state"] == "online" or not online_only)
            ),
            key=lambda n: n["id"],
        )

    def meta_address(self) -> str:
        """Where namespace requests go: the metadata primary (the first
        metadata server online, if the map names no primary)."""
        metas = self.nodes_of_kind("meta")
        if not metas:
            raise FsError(errno.EHOSTDOWN, "no metadata server is online")
        primaries = [n for n in metas if n.get("role") == "primary"]
        return (primaries or metas)[0]["address"]


class ChainWatch:
    """Calls waiting on a chain at one version, cancelled as soon as the chain
    changes (`routing_changed` is a `RoutingCache` listener). A call stuck on
    a replica that mgmtd took out (a silent head, an unreachable successor)
    is then retried on the new chain at once instead of after its timeout.
    Used by the client's chain writes, the storage daemons' forwards and the
    metadata server's storage jobs."""

    def __init__(self) -> None:
        self._waiting: set[tuple[int, int, trio.CancelScope]] = set()

    @contextlib.contextmanager
    def watching(self, chain: int, version: int) -> Iterator[trio.CancelScope]:
        """Run the body cancellable by a change of *chain* from *version*; the
        caller checks the scope's `cancelled_caught` afterwards."""
        entry = (chain, version, trio.CancelScope())
        self._waiting.add(entry)
        try:
            with entry[2]:
                yield entry[2]
        finally:
            self._waiting.discard(entry)

    def routing_changed(self, routing: Routing) -> None:
        for chain, version, scope in list(self._waiting):
            info = routing.chains.get(chain)
            if info is None or info["version"] != version:
                scope.cancel()


class RoutingCache:
    """The newest routing map known to this process."""

    def __init__(self, rpc: RpcClient, mgmtd_address: str, poll_interval: float = 1.0) -> None:
        self.mgmtd = MgmtdStub(rpc, mgmtd_address)
        self.poll_interval = poll_interval
        self._routing: Routing | None = None
        self._lock = trio.Lock()
        self.listeners: list[Callable[[Routing], None]] = []

    @property
    def current(self) -> Routing:
        if self._routing is None:
            raise FsError(errno.EHOSTDOWN, "routing map not fetched yet")
        return self._routing

    async def start(self, nursery: trio.Nursery, timeout: float = 30.0) -> Routing:
        """Fetch the first map (retrying while mgmtd is unreachable, up to
        *timeout*) and keep polling in the background."""
        backoff = Backoff(first=0.2, cap=0.2)
        with trio.move_on_after(timeout):
            while True:
                try:
                    routing = await self.refresh()
                    break
                except FsError as exc:
                    log.info("waiting for mgmtd at %s: %s", self.mgmtd.address, exc.message)
                    await backoff.sleep()
        if self._routing is None:
            raise FsError(errno.EHOSTDOWN, f"mgmtd at {self.mgmtd.address} is unreachable")
        nursery.start_soon(self._poll)
        return routing

    async def refresh(self, min_version: int | None = None) -> Routing:
        """Fetch the map if it changed (or is older than *min_version*).
        Concurrent callers share one fetch."""
        async with self._lock:
            current = self._routing
            if current is not None and min_version is not None and current.version >= min_version:
                return current
            info = await self.mgmtd.get_routing(current.version if current else -1)
            if info is not None:
                self._install(Routing(info))
            return self.current

    def _install(self, routing: Routing) -> None:
        old = self._routing
        self._routing = routing
        if old is None or routing.version != old.version:
            log.info("routing map version %d", routing.version)
            for listener in self.listeners:
                listener(routing)

    async def _poll(self) -> None:
        while True:
            await trio.sleep(self.poll_interval)
            try:
                await self.refresh()
            except FsError as exc:
                log.debug("routing refresh failed: %s", exc.message)
