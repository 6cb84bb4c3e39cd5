"""The cluster's membership, targets and chains: mgmtd's state machine.

Pure state transitions (no networking, no disk): registration, heartbeats,
timeouts and chain building change the in-memory records and bump the
routing version whenever something a client must act on changed. mgmtd
persists the records after each such change (`cluster.store`).
"""

from __future__ import annotations

import errno
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from shufflefs.cluster.placement import plan_chains
from shufflefs.cluster.protocol import (
    AssignResult,
    Capacity,
    ChainInfo,
    ClusterConfig,
    NodeInfo,
    RegisterResult,
    RoutingInfo,
    TargetInfo,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.mgmtd")

# Target states. A chain lists its targets in the order writes flow (head
# first): serving targets, then syncing ones (being brought up to date; they
# receive every new write, but serve no reads), then waiting and offline ones
# (no traffic at all).
SERVING = "serving"
SYNCING = "syncing"
WAITING = "waiting"  # back, but its chain has no serving replica to sync from yet
OFFLINE = "offline"
_RANK = {SERVING: 0, SYNCING: 1, WAITING: 2, OFFLINE: 3}


@dataclass
class Node:
    id: int
    kind: str
    address: str
    host: str
    pid: int
    state: str = "online"
    last_seen: float = 0.0
    offline_since: float = 0.0  # wall clock; kept across mgmtd restarts (`cluster/replace.py`)


@dataclass
class Target:
    id: int
    node: int
    path: str
    state: str = "serving"
    capacity: int = 0
    free: int = 0
    used: int = 0
    chunks: int = 0
    device: int = 0
    # the routing version at which the target last went offline: the one
    # offline longest has the smallest (`assign_target` replaces it first)
    offline_version: int = 0


@dataclass
class Chain:
    id: int
    version: int
    targets: list[int] = field(default_factory=list)
    # When the last serving target of a chain goes offline it holds the
    # newest data: only it may serve again without a sync. Until it returns,
    # the others wait (3FS calls this state "lastsrv").
    last_serving: int | None = None


@dataclass
class ClusterState:
    cluster_id: str
    config: ClusterConfig
    version: int = 1
    next_node: int = 1
    next_target: int = 1
    next_chain: int = 1
    nodes: dict[int, Node] = field(default_factory=dict)
    targets: dict[int, Target] = field(default_factory=dict)
    chains: dict[int, Chain] = field(default_factory=dict)
    draining_nodes: set[int] = field(default_factory=set)  # `cluster/drain.py`
    removed_nodes: set[int] = field(default_factory=set)  # never let back in under their id
    drain_chains: dict[int, int] = field(default_factory=dict)  # node -> chains it had to leave
    rebalance: dict[str, Any] | None = None  # the last rebalance job (`cluster/rebalance.py`)
    next_job: int = 1
    # dead nodes being re-replicated (node -> why) and those whose job was
    # cancelled (not started again until they were back), `cluster/replace.py`
    replacing: dict[int, str] = field(default_factory=dict)
    replace_cancelled: set[int] = field(default_factory=set)

    @classmethod
    def new(cls, config: ClusterConfig) -> ClusterState:
        return cls(cluster_id=uuid.uuid4().hex, config=config)

    # ---- persistence shape ------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return {
            "cluster_id": self.cluster_id,
            "config": dict(self.config),
            "version": self.version,
            "next_node": self.next_node,
            "next_target": self.next_target,
            "next_chain": self.next_chain,
            "nodes": [asdict(n) for n in self.nodes.values()],
            "targets": [asdict(t) for t in self.targets.values()],
            "chains": [asdict(c) for c in self.chains.values()],
            "draining_nodes": sorted(self.draining_nodes),
            "removed_nodes": sorted(self.removed_nodes),
            "drain_chains": [[n, c] for n, c in sorted(self.drain_chains.items())],
            "rebalance": self.rebalance,
            "next_job": self.next_job,
            "replacing": [[n, why] for n, why in sorted(self.replacing.items())],
            "replace_cancelled": sorted(self.replace_cancelled),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any], now: float) -> ClusterState:
        state = cls(
            cluster_id=rec["cluster_id"],
            config=rec["config"],
            version=rec["version"],
            next_node=rec["next_node"],
            next_target=rec["next_target"],
            next_chain=rec["next_chain"],
        )
        for n in rec["nodes"]:
            node = Node(**n)
            node.last_seen = now  # a grace period: nodes get one timeout to heartbeat us
            if node.state != "online" and not node.offline_since:
                node.offline_since = now  # a record from before it was kept: count from now
            state.nodes[node.id] = node
        for t in rec["targets"]:
            state.targets[t["id"]] = Target(**t)
        for c in rec["chains"]:
            state.chains[c["id"]] = Chain(**c)
        state.draining_nodes = set(rec.get("draining_nodes", []))
        state.removed_nodes = set(rec.get("removed_nodes", []))
        state.drain_chains = {int(n): int(c) for n, c in rec.get("drain_chains", [])}
        state.rebalance = rec.get("rebalance")
        state.next_job = rec.get("next_job", 1)
        state.replacing = {int(n): str(why) for n, why in rec.get("replacing", [])}
        state.replace_cancelled = set(rec.get("replace_cancelled", []))
        return state

    # ---- changes ------------------------------------------------------------

    def bump(self, why: str) -> None:
        self.version += 1
        log.info("routing version %d: %s", self.version, why)

    def register_self(self, address: str, host: str, pid: int, now: float) -> int:
        """mgmtd's own entry, so `status` lists it like every other node."""
        mine = [n for n in self.nodes.values() if n.kind == "mgmtd"]
        if mine:
            node = mine[0]
            node.address, node.host, node.pid, node.state, node.last_seen = (
                address,
                host,
                pid,
                "online",
                now,
            )
        else:
            node = Node(self.next_node, "mgmtd", address, host, pid, "online", now)
            self.next_node += 1
            self.nodes[node.id] = node
        self.bump(f"mgmtd node {node.id} at {address}")
        return node.id

    def register(
        self,
        cluster_id: str | None,
        kind: str,
        address: str,
        host: str,
        pid: int,
        node_id: int | None,
        targets: list[TargetRegistration],
        now: float,
    ) -> RegisterResult:
        if cluster_id is not None and cluster_id != self.cluster_id:
            raise FsError(
                errno.EINVAL,
                f"node belongs to cluster {cluster_id}, this is cluster {self.cluster_id}",
            )
        if kind not in ("meta", "storage"):
            raise FsError(errno.EINVAL, f"cannot register a node of kind {kind!r}")
        if kind != "storage" and targets:
            raise FsError(errno.EINVAL, "only storage nodes have targets")
        if node_id is not None and node_id in self.removed_nodes:
            raise FsError(
                errno.EPERM,
                f"node {node_id} was removed from this cluster (`shufflefs node remove`); "
                "wipe its data dir to join as a new node",
            )
        if node_id is not None and node_id in self.nodes:
            node = self.nodes[node_id]
            if node.kind != kind:
                raise FsError(errno.EINVAL, f"node {node_id} is a {node.kind} node, not {kind}")
            node.address, node.host, node.pid = address, host, pid
        else:
            if node_id is None:
                node_id = self.next_node
            node = Node(node_id, kind, address, host, pid)
            self.nodes[node_id] = node
        self.next_node = max(self.next_node, node_id + 1)
        node.state, node.last_seen = "online", now
        for other in self.nodes.values():  # an old incarnation at the same address is gone
            if other.id != node.id and other.address == address and other.state == "online":
                self._set_offline(other, f"address {address} taken by node {node.id}", now)
        target_ids = [self._register_target(node, t) for t in targets]
        self.build_chains()
        self.bump(f"{kind} node {node.id} registered at {address} pid {pid}")
        return {
            "node_id": node.id,
            "target_ids": target_ids,
            "routing_version": self.version,
            "cluster_id": self.cluster_id,
        }

    def _register_target(self, node: Node, reg: TargetRegistration) -> int:
        tid = reg["target_id"]
        if tid is not None and tid in self.targets:
            target = self.targets[tid]
            if target.node != node.id:
                raise FsError(
                    errno.EINVAL, f"target {tid} belongs to node {target.node}, not {node.id}"
                )
        else:
            if tid is None:
                tid = self.next_target
            target = Target(tid, node.id, reg["path"], state=OFFLINE)
            self.targets[tid] = target
            log.info("new target %d on node %d at %s", tid, node.id, reg["path"])
        self.next_target = max(self.next_target, tid + 1)
        target.path = reg["path"]
        target.capacity, target.free = reg["capacity"], reg["free"]
        target.device = reg["device"]
        self._rejoin(target)
        return tid

    def chain_of(self, target_id: int) -> Chain | None:
        for chain in self.chains.values():
            if target_id in chain.targets:
                return chain
        return None

    def _rejoin(self, target: Target) -> None:
        """A registering target's state. One mgmtd never cut out of its chain
        (a quick restart) missed no acknowledged write and keeps serving; one
        that was cut out syncs from a serving replica first, or, if none is
        left, serves again only if it was the chain's last serving target."""
        chain = self.chain_of(target.id)
        if chain is None:
            target.state = SERVING  # a spare: chains are built from these
            return
        if target.state == SERVING:
            return
        others = [t for t in chain.targets if t != target.id and self._state(t) == SERVING]
        if others:
            target.state = SYNCING
        elif chain.last_serving in (None, target.id):
            target.state = SERVING
            chain.last_serving = None
        else:
            target.state = WAITING
        log.info("target %d rejoins chain %d as %s", target.id, chain.id, target.state)
        self.chain_changed(chain)

    def draining(self, node_id: int) -> bool:
        return node_id in self.draining_nodes

    def _state(self, target_id: int) -> str:
        target = self.targets.get(target_id)
        return target.state if target is not None else OFFLINE

    def chain_changed(self, chain: Chain) -> None:
        """Re-derive a chain after a member changed state: waiting members
        start syncing once someone serves, members are ordered serving,
        syncing, waiting, offline (a returning target joins at the tail), and
        the chain version rises."""
        if any(self._state(t) == SERVING for t in chain.targets):
            for t in chain.targets:
                if self._state(t) == WAITING:
                    self.targets[t].state = SYNCING
        chain.targets.sort(
            key=lambda t: _RANK[self._state(t)]
        )  # stable: keeps order within a state
        chain.version += 1

    def sync_done(self, target_id: int, chain_id: int, chain_version: int) -> None:
        """A syncing target caught up: it serves from now on. Refused (ESTALE)
        if the chain changed since the sync started: the target syncs again."""
        chain = self.chains.get(chain_id)
        target = self.targets.get(target_id)
        if chain is None or target is None or target_id not in chain.targets:
            raise FsError(errno.ENOENT, f"target {target_id} is not in chain {chain_id}")
        if chain.version != chain_version:
            raise FsError(
                errno.ESTALE, f"chain {chain_id} is at version {chain.version}, not {chain_version}"
            )
        if target.state != SYNCING:
            raise FsError(errno.EINVAL, f"target {target_id} is {target.state}, not syncing")
        target.state = SERVING
        self.chain_changed(chain)
        self.bump(f"target {target_id} synced: serving in chain {chain_id}")

    def assign_target(self, target_id: int, chain_id: int | None) -> AssignResult:
        """Put a spare target (one in no chain, e.g. just added with
        ``shufflefs target add``) into a chain, at its tail as `syncing`
        (resync then brings it up to date; `waiting` if no member serves).
        Into *chain_id*, or else into the chain whose offline member has been
        offline longest. A chain that already has `replicas` members loses an
        offline member to make room (one on the new target's node first,
        else the one offline longest; never the chain's last serving target,
        which holds the only up-to-date copy). With no such chain the target
        stays a spare. Refused: unknown target (ENOENT), a target already in
        a chain (EEXIST) or on an offline node (EHOSTDOWN), a full chain
        without an offline member to replace (EBUSY), two members on one
        node (EINVAL)."""
        target = self.targets.get(target_id)
        if target is None:
            raise FsError(errno.ENOENT, f"unknown target {target_id}")
        current = self.chain_of(target_id)
        if current is not None:
            raise FsError(errno.EEXIST, f"target {target_id} is already in chain {current.id}")
        node = self.nodes.get(target.node)
        if node is None or node.state != "online" or target.state == OFFLINE:
            raise FsError(errno.EHOSTDOWN, f"target {target_id} is on an offline node")
        if self.draining(node.id):
            raise FsError(errno.EBUSY, f"target {target_id} is on node {node.id}, being drained")
        if chain_id is None:
            chain = self._chain_to_refill(target)
            if chain is None:
                log.info("target %d stays a spare: no chain has an offline member", target_id)
                return {"chain": None, "replaced": None, "state": target.state}
        else:
            found = self.chains.get(chain_id)
            if found is None:
                raise FsError(errno.ENOENT, f"unknown chain {chain_id}")
            chain = found
        replaced = self._member_to_replace(chain, target)
        if replaced is None and len(chain.targets) >= self.config["replicas"]:
            raise FsError(
                errno.EBUSY,
                f"chain {chain.id} has {len(chain.targets)} members and no offline one to replace",
            )
        others = [t for t in chain.targets if t != replaced]
        if any(self.targets[t].node == target.node for t in others if t in self.targets):
            raise FsError(
                errno.EINVAL, f"chain {chain.id} already has a target on node {target.node}"
            )
        if replaced is not None:
            chain.targets.remove(replaced)
            log.warning("target %d leaves chain %d (replaced by %d)", replaced, chain.id, target_id)
        chain.targets.append(target_id)
        serving = any(self._state(t) == SERVING for t in chain.targets if t != target_id)
        target.state = SYNCING if serving else WAITING
        self.chain_changed(chain)
        self.bump(f"target {target_id} joins chain {chain.id} as {target.state}")
        return {"chain": chain.id, "replaced": replaced, "state": target.state}

    def _chain_to_refill(self, target: Target) -> Chain | None:
        best: tuple[int, int] | None = None
        chosen: Chain | None = None
        for chain in self.chains.values():
            if any(
                self.targets[t].node == target.node and self._state(t) != OFFLINE
                for t in chain.targets
                if t in self.targets
            ):
                continue
            for t in chain.targets:
                if self._state(t) != OFFLINE or t == chain.last_serving:
                    continue
                key = (self.targets[t].offline_version if t in self.targets else 0, chain.id)
                if best is None or key < best:
                    best, chosen = key, chain
        return chosen

    def _member_to_replace(self, chain: Chain, target: Target) -> int | None:
        """The offline member a full chain gives up for *target* (None if the
        chain has room, or nothing it may give up)."""
        if len(chain.targets) < self.config["replicas"]:
            return None
        offline = [
            t for t in chain.targets if self._state(t) == OFFLINE and t != chain.last_serving
        ]
        if not offline:
            return None

        def key(t: int) -> tuple[int, int, int]:
            member = self.targets.get(t)
            same_node = member is not None and member.node == target.node
            return (0 if same_node else 1, member.offline_version if member else 0, t)

        return min(offline, key=key)

    def build_chains(self) -> list[int]:
        """Put targets that are in no chain into new chains of `replicas`
        targets on distinct nodes, spread so that every pair of nodes shares
        about as many chains as any other (`placement.plan_chains`). The
        first table waits for `initial_nodes` storage nodes, so a cluster
        whose nodes register one by one is not built from the first few."""
        storage = [n for n in self.nodes.values() if n.kind == "storage" and n.state == "online"]
        if not self.chains and len(storage) < self.config.get("initial_nodes", 0):
            return []
        if self.replacing:
            return []  # the targets a replacement creates are for the chains it fills
        placed = {t for c in self.chains.values() for t in c.targets}
        free: dict[int, list[int]] = {}
        for t in sorted(self.targets.values(), key=lambda t: t.id):
            if t.id not in placed and t.state == SERVING and not self.draining(t.node):
                free.setdefault(t.node, []).append(t.id)
        existing = [[self.targets[t].node for t in c.targets] for c in self.chains.values()]
        made: list[int] = []
        for members in plan_chains(free, self.config["replicas"], existing):
            chain = Chain(self.next_chain, 1, members)
            self.next_chain += 1
            self.chains[chain.id] = chain
            made.append(chain.id)
            log.info("new chain %d: targets %s", chain.id, chain.targets)
        return made

    def heartbeat(self, node_id: int, pid: int, usage: list[TargetUsage], now: float) -> int:
        node = self.nodes.get(node_id)
        if node is None:
            raise FsError(errno.ENOENT, f"unknown node {node_id}")
        if node.state != "online" or node.pid != pid:
            # marked offline meanwhile (or restarted): it must register again,
            # which is where its targets' states are decided
            raise FsError(errno.ENOENT, f"node {node_id} must register again")
        node.last_seen = now
        for u in usage:
            target = self.targets.get(u["target_id"])
            if target is not None and target.node == node_id:
                target.capacity, target.free = u["capacity"], u["free"]
                target.used, target.chunks = u["used"], u["chunks"]
                target.device = u["device"]
        return self.version

    def unregister(self, node_id: int) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            raise FsError(errno.ENOENT, f"unknown node {node_id}")
        if node.state == "online":
            self._set_offline(node, "clean shutdown")
            self.bump(f"node {node_id} stopped")

    def expire(self, now: float) -> list[int]:
        """Mark nodes silent for longer than the heartbeat timeout offline."""
        timeout = self.config["heartbeat_timeout"]
        gone = [
            n
            for n in self.nodes.values()
            if n.state == "online" and n.kind != "mgmtd" and now - n.last_seen > timeout
        ]
        for node in gone:
            self._set_offline(node, f"no heartbeat for {now - node.last_seen:.1f}s", now)
        if gone:
            self.bump("nodes offline: " + ", ".join(str(n.id) for n in gone))
        return [n.id for n in gone]

    def mark_offline(self, node_id: int, why: str) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.state != "online" or node.kind == "mgmtd":
            return False
        self._set_offline(node, why)
        self.bump(f"node {node_id} offline: {why}")
        return True

    def _set_offline(self, node: Node, why: str, now: float | None = None) -> None:
        log.warning("node %d (%s at %s) offline: %s", node.id, node.kind, node.address, why)
        node.state = "offline"
        node.offline_since = time.time() if now is None else now
        for target in self.targets.values():
            if target.node != node.id or target.state == OFFLINE:
                continue
            was_serving = target.state == SERVING
            target.state = OFFLINE
            target.offline_version = self.version
            chain = self.chain_of(target.id)
            if chain is None:
                continue
            if was_serving and not any(self._state(t) == SERVING for t in chain.targets):
                chain.last_serving = target.id
                log.error("chain %d has no serving target left (last: %d)", chain.id, target.id)
            self.chain_changed(chain)

    # ---- views --------------------------------------------------------------

    def routing(self) -> RoutingInfo:
        return {
            "version": self.version,
            "cluster_id": self.cluster_id,
            "config": self.config,
            "nodes": [self._node_info(n) for n in sorted(self.nodes.values(), key=lambda n: n.id)],
            "targets": [
                self._target_info(t) for t in sorted(self.targets.values(), key=lambda t: t.id)
            ],
            "chains": [
                ChainInfo(id=c.id, version=c.version, targets=list(c.targets))
                for c in sorted(self.chains.values(), key=lambda c: c.id)
            ],
        }

    def _node_info(self, n: Node) -> NodeInfo:
        return NodeInfo(
            id=n.id,
            kind=n.kind,
            address=n.address,
            host=n.host,
            pid=n.pid,
            state=n.state,
            last_seen=n.last_seen,
            draining=n.id in self.draining_nodes,
            replacing=n.id in self.replacing,
        )

    @staticmethod
    def _target_info(t: Target) -> TargetInfo:
        return TargetInfo(
            id=t.id,
            node=t.node,
            path=t.path,
            state=t.state,
            capacity=t.capacity,
            free=t.free,
            used=t.used,
            chunks=t.chunks,
        )

    def capacity(self) -> Capacity:
        """Usable bytes over the serving targets, divided by the replica count.
        Targets on one filesystem (same host and device) share its space, so
        it is counted once (a local cluster has all its targets on one disk)."""
        serving = [t for t in self.targets.values() if t.state == SERVING]
        replicas = max(1, self.config["replicas"])
        filesystems: dict[tuple[str, int], tuple[int, int]] = {}
        for t in serving:
            node = self.nodes.get(t.node)
            key = (node.host if node else "", t.device) if t.device else ("target", t.id)
            filesystems[key] = (t.capacity, t.free)
        return Capacity(
            capacity=sum(c for c, _ in filesystems.values()) // replicas,
            free=sum(f for _, f in filesystems.values()) // replicas,
            used=sum(t.used for t in serving) // replicas,
        )
