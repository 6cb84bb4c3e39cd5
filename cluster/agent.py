"""A server's membership: register with mgmtd, then heartbeat until stopped.

Every metadata server and storage daemon runs one `NodeAgent`. It keeps
trying while mgmtd is unreachable (mgmtd may start later or restart), registers
again when mgmtd no longer knows the node, reports target usage with every
heartbeat, and tells its owner when the routing map has a newer version.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable

import trio

from shufflefs.cluster.protocol import MgmtdStub, RegisterResult, TargetRegistration, TargetUsage
from shufflefs.rpc.client import open_rpc_client
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import Backoff

log = logging.getLogger("shufflefs.agent")


class NodeAgent:
    def __init__(
        self,
        mgmtd: MgmtdStub,
        *,
        kind: str,
        address: str,
        host: str,
        cluster_id: str | None,
        node_id: int | None,
        targets: Callable[[], list[TargetRegistration]] = list,
        usage: Callable[[], list[TargetUsage]] = list,
        on_registered: Callable[[RegisterResult], None] | None = None,
        on_routing_version: Callable[[int], Awaitable[None]] | None = None,
        interval: float = 1.0,
    ) -> None:
        self.mgmtd = mgmtd
        self.kind = kind
        self.address = address
        self.host = host
        self.cluster_id = cluster_id
        self.node_id = node_id
        self.targets = targets
        self.usage = usage
        self.on_registered = on_registered
        self.on_routing_version = on_routing_version
        self.interval = interval
        self.routing_version = -1
        self.registered = trio.Event()

    async def register(self) -> RegisterResult:
        """Register, retrying while mgmtd is unreachable. A refusal (EINVAL:
        another cluster's node) is final and raised."""
        backoff = Backoff(first=0.1, cap=2.0)
        while True:
            try:
                result = await self.mgmtd.register_node(
                    self.cluster_id,
                    self.kind,
                    self.address,
                    self.host,
                    os.getpid(),
                    self.node_id,
                    self.targets(),
                )
            except FsError as exc:
                if exc.code in (errno.EINVAL, errno.EPERM, errno.EACCES):
                    raise
                log.info(
                    "registering with mgmtd at %s: %s; retrying", self.mgmtd.address, exc.message
                )
                await backoff.sleep()
                continue
            self.node_id = result["node_id"]
            self.cluster_id = result["cluster_id"]
            log.info(
                "registered with mgmtd as %s node %d (cluster %s)",
                self.kind,
                self.node_id,
                self.cluster_id,
            )
            if self.on_registered is not None:
                self.on_registered(result)
            await self._routing_seen(result["routing_version"])
            self.registered.set()
            return result

    async def run(
        self, *, task_status: trio.TaskStatus[RegisterResult] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Register, report it through *task_status*, then heartbeat forever."""
        result = await self.register()
        task_status.started(result)
        while True:
            await trio.sleep(self.interval)
            assert self.node_id is not None
            try:
                version = await self.mgmtd.heartbeat(self.node_id, os.getpid(), self.usage())
            except FsError as exc:
                if exc.code == errno.ENOENT:
                    log.warning("mgmtd does not know node %d; registering again", self.node_id)
                    await self.register()
                else:
                    log.debug("heartbeat failed: %s", exc.message)
                continue
            await self._routing_seen(version)

    async def _routing_seen(self, version: int) -> None:
        if version > self.routing_version:
            self.routing_version = version
            if self.on_routing_version is not None:
                try:
                    await self.on_routing_version(version)
                except FsError as exc:
                    log.debug("routing refresh failed: %s", exc.message)


async def unregister_node(secret: bytes, mgmtd_address: str, node_id: int) -> None:
    """Tell mgmtd this node stops (best effort, bounded to 2 s), so it is
    offline at once rather than after the heartbeat timeout.

    Call it from a service's ``finally`` inside a shielded cancel scope: it
    opens a client of its own, because on a stop the service's client is being
    cancelled with everything else and its connection may already be closed."""
    with trio.move_on_after(2.0):
        async with open_rpc_client(secret) as rpc:
            try:  # inside the client's nursery: outside it, trio wraps the error in a group
                await MgmtdStub(rpc, mgmtd_address).unregister_node(node_id)
            except FsError as exc:
                log.warning("unregistering node=%d failed: %s", node_id, exc.message)
                return
        log.info("unregistered node=%d from mgmtd", node_id)
