"""mgmtd's wire protocol: message shapes and a typed stub.

mgmtd owns membership (nodes and their heartbeats), the storage targets, the
replication chains and the routing map that ties them together. The routing
map has a version that rises on every change a client must act on (a node or
target changing state, a chain changing members); capacity figures ride along
but do not bump the version.

Other components import this module (and `cluster.routing`, `cluster.agent`,
which are built on it), never mgmtd's internals.
"""

from __future__ import annotations

import errno
from typing import Any, Literal, NotRequired, TypedDict

import trio

from shufflefs.rpc.addresses import mgmtd_addresses
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError
from shufflefs.rpc.retry import Backoff

NodeKind = Literal["mgmtd", "meta", "storage"]
NodeState = Literal["online", "offline"]
# serving: in its chain and up to date; syncing: back and being brought up to
# date (receives new writes, serves no reads); waiting: back, but its chain has
# no serving replica to sync from; offline: its node is down or it was cut out.
TargetState = Literal["serving", "syncing", "waiting", "offline"]


class TargetRegistration(TypedDict):
    target_id: int | None  # None on a target's first start; afterwards the id mgmtd gave it
    path: str
    capacity: int
    free: int
    device: int  # st_dev of the target's filesystem: targets sharing one are counted once


class RegisterResult(TypedDict):
    node_id: int
    target_ids: list[int]  # in the order of the registration's targets
    routing_version: int
    cluster_id: str


class TargetUsage(TypedDict):
    target_id: int
    capacity: int  # bytes of the filesystem the target lives on
    free: int  # bytes still available to the target (after its reserve)
    used: int  # bytes of chunk data held
    chunks: int
    device: int


class NodeInfo(TypedDict):
    id: int
    kind: str  # NodeKind
    address: str  # host:port the node serves rpc on
    host: str  # the machine's name, for locality
    pid: int
    state: str  # NodeState
    last_seen: float  # unix time of the last heartbeat
    # metadata servers only (cluster/meta_leases.py): primary or follower,
    # the primary's epoch (a follower's: of its newest entry), log position
    role: NotRequired[str]
    epoch: NotRequired[int]
    applied_seq: NotRequired[int]
    draining: NotRequired[bool]  # being drained (`shufflefs node drain`); in no chain: drained
    replacing: NotRequired[bool]  # dead, being re-replicated (`cluster/replace.py`)


class LeaseReply(TypedDict):
    """mgmtd's answer to a metadata server's lease request."""

    granted: bool  # the caller holds the lease (for ttl seconds from its request)
    holder: int | None  # node id of the metadata primary, if any
    epoch: int
    ttl: float


class TargetInfo(TypedDict):
    id: int
    node: int
    path: str
    state: str  # TargetState
    capacity: int
    free: int
    used: int
    chunks: int


class ChainInfo(TypedDict):
    id: int
    version: int  # rises whenever the chain's members or their order change
    targets: list[int]  # head first, tail last


class ClusterConfig(TypedDict):
    chunk_size: int  # default chunk size of new files (power of two)
    stripe: int  # chains a new file is striped over (at most)
    replicas: int  # targets per chain
    min_replicas: int  # writes are refused (EROFS) on a chain with fewer serving targets
    heartbeat_interval: float  # seconds between heartbeats
    heartbeat_timeout: float  # a node silent this long is offline
    # the first chain table waits for this many storage nodes (0: for `replicas`)
    initial_nodes: NotRequired[int]
    # re-replication of dead storage nodes (`cluster/replace.py`)
    replace_offline_after: NotRequired[float]
    replace_max_offline: NotRequired[int]
    replace_parallel: NotRequired[int]


class AssignResult(TypedDict):
    chain: int | None  # the chain the target joined, None: it stays a spare
    replaced: int | None  # the offline member it took the place of
    state: str  # its state now (syncing; waiting if nobody in the chain serves)


class JobInfo(TypedDict):
    """A background job of mgmtd (`shufflefs jobs`, `cluster/jobs.py`)."""

    id: str  # drain-NODE, rebalance-N, resync-TARGET: the same after an mgmtd restart
    kind: str  # drain, rebalance, resync
    state: str  # running (resync: syncing/waiting); a rebalance also done or cancelled
    done: int  # chains moved (drain), moves made (rebalance)
    left: int  # chains / moves still to go, as planned now
    detail: str


class MgmtdRole(TypedDict):
    role: str  # "primary" or "standby"
    address: str  # this instance's
    primary: str | None  # the primary's address, if known
    backend: str  # "embedded" or "etcd"


class RoutingInfo(TypedDict):
    version: int
    cluster_id: str
    config: ClusterConfig
    nodes: list[NodeInfo]
    targets: list[TargetInfo]
    chains: list[ChainInfo]


class Capacity(TypedDict):
    capacity: int
    free: int
    used: int


# A standby mgmtd's answer to anything but `role`: ask the primary (named in
# the message when known). The stub below does so by itself.
NOT_PRIMARY = errno.EREMOTE


class MgmtdStub:
    """Typed calls to mgmtd. *address* may list several mgmtd instances
    (``a:1,b:2``): a call goes to the one that answered last, and moves on to
    the others when it is unreachable or a standby (`NOT_PRIMARY`), until one
    answers or the timeout has passed (a failover in progress)."""

    def __init__(self, rpc: RpcClient, address: str, timeout: float = 5.0) -> None:
        self.rpc = rpc
        self.addresses = mgmtd_addresses(address) if "," in address else [address]
        self.address = self.addresses[0]
        self.timeout = timeout

    async def _call(self, method: str, **args: Any) -> Any:
        deadline = trio.current_time() + self.timeout
        backoff = Backoff(first=0.05, cap=0.5)
        last = FsError(errno.EHOSTDOWN, "no mgmtd answered")
        while True:
            for address in [self.address] + [a for a in self.addresses if a != self.address]:
                remaining = deadline - trio.current_time()
                try:
                    result = await self.rpc.call(address, method, args, timeout=max(0.1, remaining))
                except FsError as exc:
                    # a lone mgmtd that is down: say so at once (callers retry)
                    alone = len(self.addresses) == 1 and exc.code in CONNECTION_FAILURES
                    if alone or exc.code not in CONNECTION_FAILURES | {NOT_PRIMARY}:
                        raise
                    last = exc
                    continue
                self.address = address
                return result
            if trio.current_time() + backoff.delay > deadline:
                raise last
            await backoff.sleep()

    async def role(self) -> MgmtdRole:
        """This instance's role (answered by standbys too)."""
        result: MgmtdRole = await self.rpc.call(self.address, "role", {}, timeout=self.timeout)
        return result

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
        """Join the cluster (or rejoin under a known node id). *cluster_id* is
        None on a node's first start (it then keeps the id it is told); a node
        or target that belongs to another cluster is refused with EINVAL."""
        result: RegisterResult = await self._call(
            "register_node",
            cluster_id=cluster_id,
            kind=kind,
            address=address,
            host=host,
            pid=pid,
            node_id=node_id,
            targets=targets,
        )
        return result

    async def heartbeat(self, node_id: int, pid: int, targets: list[TargetUsage]) -> int:
        """Report liveness and usage; returns the current routing version.
        ENOENT means mgmtd does not know the node: register again."""
        result = await self._call("heartbeat", node_id=node_id, pid=pid, targets=targets)
        return int(result["routing_version"])

    async def unregister_node(self, node_id: int) -> None:
        """A clean shutdown: the node is offline at once, not after the timeout."""
        await self._call("unregister_node", node_id=node_id)

    async def sync_done(self, target_id: int, chain_id: int, chain_version: int) -> None:
        """A syncing target has caught up with its chain (as of *chain_version*)
        and may serve reads. ESTALE: the chain changed meanwhile; sync again."""
        await self._call(
            "sync_done", target_id=target_id, chain_id=chain_id, chain_version=chain_version
        )

    async def report_unreachable(self, reporter: int, node_id: int) -> bool:
        """A peer could not reach *node_id*. mgmtd checks for itself and marks
        the node offline if it cannot reach it either. Returns whether it did."""
        result = await self._call("report_unreachable", reporter=reporter, node_id=node_id)
        return bool(result)

    async def drain_node(self, node_id: int) -> list[int]:
        """Start draining storage node *node_id* (`cluster/drain.py`): the
        chains it leaves. EBUSY if one of them has nowhere to move to."""
        chains: list[int] = await self._call("drain_node", node_id=node_id)
        return chains

    async def rebalance(self) -> JobInfo:
        """Start a rebalance (`cluster/rebalance.py`), or attach to the one
        running. EBUSY while a drain runs, EALREADY when nothing would move."""
        result: JobInfo = await self._call("rebalance")
        return result

    async def jobs(self) -> list[JobInfo]:
        """Running drains, the rebalance (also once ended) and resyncs."""
        result: list[JobInfo] = await self._call("jobs")
        return result

    async def cancel_job(self, job_id: str) -> JobInfo:
        """Cancel a drain or the rebalance: no new moves, the one in flight rolled back."""
        result: JobInfo = await self._call("cancel_job", job_id=job_id)
        return result

    async def remove_node(self, node_id: int) -> None:
        """Forget a drained (or never placed) storage node; EBUSY while it holds replicas."""
        await self._call("remove_node", node_id=node_id)

    async def remove_target(self, target_id: int) -> None:
        """Forget a target in no chain; EBUSY while it is a member of one."""
        await self._call("remove_target", target_id=target_id)

    async def assign_target(self, target_id: int, chain_id: int | None = None) -> AssignResult:
        """Put a spare target into chain *chain_id* (or the chain whose
        offline member has been offline longest), at the tail as syncing,
        replacing an offline member of a full chain. ``chain`` None in the
        result: no chain needed it, it stays a spare."""
        result: AssignResult = await self._call(
            "assign_target", target_id=target_id, chain_id=chain_id
        )
        return result

    async def get_routing(self, known_version: int = -1) -> RoutingInfo | None:
        """The routing map, or None if it is still at *known_version*."""
        result: RoutingInfo | None = await self._call("get_routing", known_version=known_version)
        return result

    async def meta_lease(
        self, node_id: int, applied_seq: int, applied_epoch: int, group_size: int
    ) -> LeaseReply:
        """Ask for (or renew) the metadata primary's lease, reporting this
        server's log position (cluster/meta_leases.py)."""
        result: LeaseReply = await self._call(
            "meta_lease",
            node_id=node_id,
            applied_seq=applied_seq,
            applied_epoch=applied_epoch,
            group_size=group_size,
        )
        return result

    async def status(self) -> RoutingInfo:
        """The routing map with fresh capacity figures (for `shufflefs status`)."""
        result: RoutingInfo = await self._call("status")
        return result

    async def capacity(self) -> Capacity:
        """Totals over the serving targets (for statfs)."""
        result: Capacity = await self._call("capacity")
        return result
