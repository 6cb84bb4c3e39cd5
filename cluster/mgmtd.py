"""mgmtd: the cluster manager.

Serves the routing map (nodes, targets, chains and its version), takes
registrations and heartbeats, marks silent nodes offline, and persists every
change durably before acknowledging it, so a restarted mgmtd comes back with
the same cluster. Where it persists, and whether this instance is the
primary, is the coordination backend's (cluster/coordination.py): embedded
(LMDB, always primary) or etcd (several instances, one elected primary; a
standby answers only `role` and refuses the rest with `NOT_PRIMARY`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster import drain, jobs, rebalance, replace
from shufflefs.cluster.config import MgmtdConfig
from shufflefs.cluster.coordination import Coordination, EmbeddedCoordination, open_coordination
from shufflefs.cluster.meta_leases import MetaLeases
from shufflefs.cluster.metrics_registry import MetricsDirectory
from shufflefs.cluster.node import advertised_address, listen_address
from shufflefs.cluster.protocol import (
    AssignResult,
    Capacity,
    ClusterConfig,
    JobInfo,
    LeaseReply,
    MgmtdRole,
    RegisterResult,
    RoutingInfo,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.cluster.state import ClusterState
from shufflefs.cluster.web import start_web
from shufflefs.rpc.addresses import hostname, parse_address
from shufflefs.rpc.client import RpcClient, open_rpc_client
from shufflefs.rpc.cluster_secret import load_secret
from shufflefs.rpc.config import load_config
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.runtime import run_service, setup_logging
from shufflefs.rpc.schema import rpc_method
from shufflefs.rpc.server import RpcServer
from shufflefs.storage.protocol import StorageStub

log = logging.getLogger("shufflefs.mgmtd")

EXPIRY_CHECK_INTERVAL = 0.5
UNREACHABLE_PROBE_TIMEOUT = 2.0
PROVISION_TIMEOUT = 60.0  # a storage daemon formatting a target for a replacement
PROVISION_RETRY = 30.0  # seconds before asking again for a target a node could not create


class MgmtdService:
    def __init__(
        self,
        state: ClusterState | None,
        coordination: Coordination,
        rpc: RpcClient | None = None,
        address: str = "",
    ) -> None:
        self._state = state  # None while a standby
        self.coordination = coordination
        self.rpc = rpc
        self.address = address
        self.leases = MetaLeases()  # the metadata primary's lease policy
        self.node_id: int | None = None  # mgmtd's own node entry, once primary
        self._persist_lock = trio.Lock()
        self._lease_lock = trio.Lock()
        self._provisioning: set[str] = set()  # paths of targets being created for replacements
        self._provision_failed: dict[str, float] = {}  # path -> when its creation failed

    def state(self) -> ClusterState:
        """The cluster state, only while this instance is the primary: every
        rpc method but `role` goes through here, so a standby refuses them all."""
        if self._state is None or self.coordination.role != "primary":
            raise self.coordination.not_primary()
        return self._state

    def take_over(self, state: ClusterState | None) -> None:
        """Become the primary with *state* (None: step down to standby)."""
        self._state = state
        self.leases = MetaLeases()  # reports start afresh: nobody takes over on old ones

    async def persist(self) -> None:
        """Commit the current state durably. The record is taken inside the
        lock, so a later commit never loses to an earlier one."""
        async with self._persist_lock:
            record = self.state().to_record()
            await self.coordination.save(record)

    @rpc_method(inline=True)
    async def role(self) -> MgmtdRole:
        """Answered by a standby too: who is the primary."""
        return MgmtdRole(
            role=self.coordination.role,
            address=self.address,
            primary=self.coordination.primary,
            backend="embedded" if isinstance(self.coordination, EmbeddedCoordination) else "etcd",
        )

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
        parse_address(address)
        result = self.state().register(
            cluster_id, kind, address, host, pid, node_id, targets, time.time()
        )
        await self.persist()
        return result

    @rpc_method(inline=True)
    async def heartbeat(self, node_id: int, pid: int, targets: list[TargetUsage]) -> dict[str, int]:
        return {"routing_version": self.state().heartbeat(node_id, pid, targets, time.time())}

    @rpc_method
    async def unregister_node(self, node_id: int) -> None:
        self.state().unregister(node_id)
        await self.leases.forget(self.coordination, node_id)
        await self.persist()

    @rpc_method
    async def meta_lease(
        self, node_id: int, applied_seq: int, applied_epoch: int, group_size: int = 1
    ) -> LeaseReply:
        """A metadata server asks for (or renews) the primary's lease and
        reports its log position (`cluster/meta_leases.py`)."""
        state = self.state()
        node = state.nodes.get(node_id)
        if node is None or node.kind != "meta":
            raise FsError(errno.ENOENT, f"node {node_id} is not a registered metadata server")
        members = {n.id for n in state.nodes.values() if n.kind == "meta"}
        async with self._lease_lock:  # one at a time: a grant is saved before it is answered
            reply, changed = await self.leases.request(
                self.coordination,
                node_id,
                applied_seq,
                applied_epoch,
                members,
                group_size,
                trio.current_time(),
            )
        if changed:
            # the holder, which need not be the requester (a new mgmtd primary
            # learns the live lease from etcd on anyone's request)
            holder = reply["holder"]
            state.bump(
                f"metadata primary node {holder} epoch {reply['epoch']}"
                if holder is not None
                else f"no metadata primary (epoch {reply['epoch']} lapsed)"
            )
            await self.persist()
        return reply

    def routing_info(self) -> RoutingInfo:
        """The routing map with the metadata servers' roles (NOT_PRIMARY on a standby)."""
        info = self.state().routing()
        self.leases.annotate(info["nodes"], trio.current_time())
        return info

    @rpc_method
    async def sync_done(self, target_id: int, chain_id: int, chain_version: int) -> None:
        self.state().sync_done(target_id, chain_id, chain_version)
        self.step_jobs(self.state())  # a newcomer serving: an old member may leave
        await self.persist()

    @staticmethod
    def step_jobs(state: ClusterState) -> bool:
        """Move drains, replacements and the rebalance on (a rebalance never
        runs beside the others)."""
        drained = drain.step(state)
        replaced, _ = replace.step(state)  # targets to create: `watch_heartbeats`
        return rebalance.step(state) or drained or replaced

    @rpc_method
    async def drain_node(self, node_id: int) -> list[int]:
        state = self.state()
        chains = drain.start(state, node_id)
        drain.step(state)
        await self.persist()
        return chains

    @rpc_method
    async def rebalance(self) -> JobInfo:
        state = self.state()
        rebalance.start(state)
        await self.persist()
        return next(j for j in jobs.jobs(state) if j["kind"] == "rebalance")

    @rpc_method(inline=True)
    async def jobs(self) -> list[JobInfo]:
        return jobs.jobs(self.state())

    @rpc_method
    async def cancel_job(self, job_id: str) -> JobInfo:
        result = jobs.cancel(self.state(), job_id)
        await self.persist()
        return result

    @rpc_method
    async def remove_node(self, node_id: int) -> None:
        drain.remove_node(self.state(), node_id)
        await self.persist()

    @rpc_method
    async def remove_target(self, target_id: int) -> None:
        drain.remove_target(self.state(), target_id)
        await self.persist()

    @rpc_method
    async def assign_target(self, target_id: int, chain_id: int | None) -> AssignResult:
        result = self.state().assign_target(target_id, chain_id)
        if result["chain"] is not None:
            await self.persist()
        return result

    @rpc_method
    async def report_unreachable(self, reporter: int, node_id: int) -> bool:
        """Believe a peer's report only if we cannot reach the node either: a
        link broken between two storage nodes alone must not take one out."""
        node = self.state().nodes.get(node_id)
        if node is None or node.state != "online" or self.rpc is None:
            return False
        try:
            await self.rpc.call(node.address, "ping", timeout=UNREACHABLE_PROBE_TIMEOUT)
            log.info("node %d reported node %d unreachable; it answers us", reporter, node_id)
            return False
        except FsError as exc:
            why = f"unreachable from node {reporter} and from mgmtd ({exc.message})"
        if self.state().mark_offline(node_id, why):
            await self.persist()
            return True
        return False

    @rpc_method(inline=True)
    async def get_routing(self, known_version: int) -> RoutingInfo | None:
        if known_version == self.state().version:
            return None
        return self.routing_info()

    @rpc_method(inline=True)
    async def status(self) -> RoutingInfo:
        return self.routing_info()

    @rpc_method(inline=True)
    async def capacity(self) -> Capacity:
        return self.state().capacity()

    async def watch_heartbeats(self) -> None:
        async with trio.open_nursery() as nursery:
            while self._state is not None:
                await trio.sleep(EXPIRY_CHECK_INTERVAL)
                state = self.state()
                now = time.time()
                expired = state.expire(now)
                due = replace.due(state, now)
                for node_id in due:
                    replace.start(state, node_id, now)
                moved, wanted = replace.step(state)
                # jobs resume after any restart
                if self.step_jobs(state) or expired or due or moved:
                    await self.persist()
                for provision in wanted:
                    failed = self._provision_failed.get(provision.path)
                    if failed is not None and trio.current_time() - failed < PROVISION_RETRY:
                        continue
                    if provision.path not in self._provisioning:
                        self._provisioning.add(provision.path)
                        nursery.start_soon(self.provision, provision)

    async def provision(self, want: replace.Provision) -> None:
        """Have storage node *want.node* create a target for a replacement; it
        registers it (a spare), and the next step puts it into the chain."""
        try:
            node = self.state().nodes.get(want.node)
            if node is None or self.rpc is None:
                return
            log.info(
                "creating target %s on node %d for chain %d (replacement)",
                want.path,
                want.node,
                want.chain,
            )
            stub = StorageStub(self.rpc, node.address, timeout=PROVISION_TIMEOUT)
            with trio.move_on_after(PROVISION_TIMEOUT + 5):
                target = await stub.add_target(want.path)
                log.info("node %d created target %d at %s", want.node, target, want.path)
                moved, _ = replace.step(self.state())  # it joins now, not at the next tick
                if moved:
                    await self.persist()
        except FsError as exc:
            self._provision_failed[want.path] = trio.current_time()
            log.warning(
                "node %d could not create target %s (asked again in %.0fs): %s",
                want.node,
                want.path,
                PROVISION_RETRY,
                exc.message,
            )
        finally:
            self._provisioning.discard(want.path)


def cluster_config(config: MgmtdConfig) -> ClusterConfig:
    return ClusterConfig(
        chunk_size=config.chunk_size,
        stripe=config.stripe,
        replicas=config.replicas,
        min_replicas=config.effective_min_replicas,
        heartbeat_interval=config.heartbeat_interval,
        heartbeat_timeout=config.heartbeat_timeout,
        initial_nodes=config.initial_nodes,
        replace_offline_after=config.replace_offline_after,
        replace_max_offline=config.replace_max_offline,
        replace_parallel=config.replace_parallel,
    )


def open_state(config: MgmtdConfig, record: dict[str, Any] | None) -> ClusterState:
    """The persisted cluster (*record*), or a new one on first start."""
    wanted = cluster_config(config)
    if record is None:
        state = ClusterState.new(wanted)
        log.info("new cluster %s, config %s", state.cluster_id, wanted)
        return state
    state = ClusterState.from_record(record, time.time())
    if state.config["replicas"] != wanted["replicas"]:
        log.warning(
            "replicas is %d in the config but the cluster was formatted with %d; keeping %d",
            wanted["replicas"],
            state.config["replicas"],
            state.config["replicas"],
        )
        wanted["replicas"] = state.config["replicas"]
        wanted["min_replicas"] = min(wanted["min_replicas"], wanted["replicas"])
    state.config = wanted
    log.info(
        "loaded cluster %s: %d nodes, %d targets, %d chains, routing version %d",
        state.cluster_id,
        len(state.nodes),
        len(state.targets),
        len(state.chains),
        state.version,
    )
    return state


async def serve_terms(config: MgmtdConfig, service: MgmtdService) -> None:
    """Each time this instance is elected: load the state (fresh: a previous
    primary may have changed it), take it over, watch heartbeats; on losing
    the election, back to standby."""
    coordination = service.coordination
    while True:
        elected, deposed = coordination.elected, coordination.deposed
        await elected.wait()
        try:
            state = open_state(config, await coordination.load())
            # every node gets a whole heartbeat timeout from now to show it is alive
            service.node_id = state.register_self(
                service.address, config.host or hostname(), os.getpid(), time.time()
            )
            service.take_over(state)
            await service.persist()
        except FsError as exc:
            log.warning("taking over as primary failed: %s", exc.message)
            service.take_over(None)
            await trio.sleep(0.5)
            continue
        log.info("mgmtd primary at %s, routing version %d", service.address, state.version)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.watch_heartbeats)
            await deposed.wait()
            nursery.cancel_scope.cancel()
        service.take_over(None)
        log.warning("mgmtd at %s is a standby now", service.address)


async def serve(config: MgmtdConfig) -> None:
    secret = load_secret(Path(config.secret_file))
    coordination = open_coordination(
        config.data_dir, config.etcd, config.etcd_prefix, config.election_ttl
    )
    try:
        host, port = listen_address(config.listen)
        async with (
            open_rpc_client(secret, connect_timeout=1.0) as rpc,
            trio.open_nursery() as nursery,
        ):
            service = MgmtdService(None, coordination, rpc)
            directory = MetricsDirectory()
            server = RpcServer(secret, [service, directory], name="mgmtd")
            bound = await nursery.start(server.serve, host, port)
            service.address = advertised_address(
                host, bound, advertise=config.advertise, host=config.host
            )
            nursery.start_soon(serve_terms, config, service)
            await nursery.start(coordination.campaign, service.address)
            await start_web(
                nursery,
                config.metrics,
                routing=service.routing_info,
                capacity=lambda: service.state().capacity(),
                jobs=lambda: jobs.jobs(service.state()),
                directory=directory,
                rpc=rpc,
                mgmtd=service.address,
                node=lambda: service.node_id,
            )
    finally:
        coordination.close()


def main(config_path: str) -> int:
    config = load_config(config_path, MgmtdConfig)
    setup_logging("mgmtd", config.log_file, config.log_level)
    return run_service("mgmtd", lambda: serve(config))


def cli_main(args: argparse.Namespace) -> int:
    return main(args.config)
