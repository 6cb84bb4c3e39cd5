"""mgmtd: the cluster manager.

Serves the routing map (nodes, targets, chains and its version), takes
registrations and heartbeats, marks silent nodes offline, and persists every
change durably before acknowledging it, so a restarted mgmtd comes back with
the same cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import trio

from shufflefs.cluster import drain
from shufflefs.cluster.config import MgmtdConfig
from shufflefs.cluster.node import advertised_address, listen_address
from shufflefs.cluster.protocol import (
    AssignResult,
    Capacity,
    ClusterConfig,
    RegisterResult,
    RoutingInfo,
    TargetRegistration,
    TargetUsage,
)
from shufflefs.cluster.state import ClusterState
from shufflefs.cluster.store import MgmtdStore
from shufflefs.rpc.auth import load_secret
from shufflefs.rpc.client import RpcClient, open_rpc_client, parse_address
from shufflefs.rpc.config import load_config
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.runtime import hostname, run_service, setup_logging
from shufflefs.rpc.schema import rpc_method
from shufflefs.rpc.server import RpcServer

log = logging.getLogger("shufflefs.mgmtd")

EXPIRY_CHECK_INTERVAL = 0.5
UNREACHABLE_PROBE_TIMEOUT = 2.0


class MgmtdService:
    def __init__(
        self, state: ClusterState, store: MgmtdStore, rpc: RpcClient | None = None
    ) -> None:
        self.state = state
        self.store = store
        self.rpc = rpc
        self._persist_lock = trio.Lock()

    async def persist(self) -> None:
        """Commit the current state durably (off the event loop). The record
        is taken inside the lock, so a later commit never loses to an earlier one."""
        async with self._persist_lock:
            record = self.state.to_record()
            await trio.to_thread.run_sync(self.store.save, record)

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
        result = self.state.register(
            cluster_id, kind, address, host, pid, node_id, targets, time.time()
        )
        await self.persist()
        return result

    @rpc_method(inline=True)
    async def heartbeat(self, node_id: int, pid: int, targets: list[TargetUsage]) -> dict[str, int]:
        return {"routing_version": self.state.heartbeat(node_id, pid, targets, time.time())}

    @rpc_method
    async def unregister_node(self, node_id: int) -> None:
        self.state.unregister(node_id)
        await self.persist()

    @rpc_method
    async def sync_done(self, target_id: int, chain_id: int, chain_version: int) -> None:
        self.state.sync_done(target_id, chain_id, chain_version)
        drain.step(self.state)  # a replacement serving: a drained member may leave
        await self.persist()

    @rpc_method
    async def drain_node(self, node_id: int) -> list[int]:
        chains = drain.start(self.state, node_id)
        drain.step(self.state)
        await self.persist()
        return chains

    @rpc_method
    async def remove_node(self, node_id: int) -> None:
        drain.remove_node(self.state, node_id)
        await self.persist()

    @rpc_method
    async def remove_target(self, target_id: int) -> None:
        drain.remove_target(self.state, target_id)
        await self.persist()

    @rpc_method
    async def assign_target(self, target_id: int, chain_id: int | None) -> AssignResult:
        result = self.state.assign_target(target_id, chain_id)
        if result["chain"] is not None:
            await self.persist()
        return result

    @rpc_method
    async def report_unreachable(self, reporter: int, node_id: int) -> bool:
        """Believe a peer's report only if we cannot reach the node either: a
        link broken between two storage nodes alone must not take one out."""
        node = self.state.nodes.get(node_id)
        if node is None or node.state != "online" or self.rpc is None:
            return False
        try:
            await self.rpc.call(node.address, "ping", timeout=UNREACHABLE_PROBE_TIMEOUT)
            log.info("node %d reported node %d unreachable; it answers us", reporter, node_id)
            return False
        except FsError as exc:
            why = f"unreachable from node {reporter} and from mgmtd ({exc.message})"
        if self.state.mark_offline(node_id, why):
            await self.persist()
            return True
        return False

    @rpc_method(inline=True)
    async def get_routing(self, known_version: int) -> RoutingInfo | None:
        if known_version == self.state.version:
            return None
        return self.state.routing()

    @rpc_method(inline=True)
    async def status(self) -> RoutingInfo:
        return self.state.routing()

    @rpc_method(inline=True)
    async def capacity(self) -> Capacity:
        return self.state.capacity()

    async def watch_heartbeats(self) -> None:
        while True:
            await trio.sleep(EXPIRY_CHECK_INTERVAL)
            expired = self.state.expire(time.time())
            if drain.step(self.state) or expired:  # drains resume after any restart
                await self.persist()


def cluster_config(config: MgmtdConfig) -> ClusterConfig:
    return ClusterConfig(
        chunk_size=config.chunk_size,
        stripe=config.stripe,
        replicas=config.replicas,
        min_replicas=config.effective_min_replicas,
        heartbeat_interval=config.heartbeat_interval,
        heartbeat_timeout=config.heartbeat_timeout,
        initial_nodes=config.initial_nodes,
    )


def open_state(config: MgmtdConfig, store: MgmtdStore) -> ClusterState:
    """Load the persisted cluster, or create a new one on first start."""
    record = store.load()
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


async def serve(config: MgmtdConfig) -> None:
    secret = load_secret(Path(config.secret_file))
    store = MgmtdStore(config.data_dir)
    try:
        state = open_state(config, store)
        host, port = listen_address(config.listen)
        async with (
            open_rpc_client(secret, connect_timeout=1.0) as rpc,
            trio.open_nursery() as nursery,
        ):
            service = MgmtdService(state, store, rpc)
            server = RpcServer(secret, [service], name="mgmtd")
            bound = await nursery.start(server.serve, host, port)
            advertise = advertised_address(
                host, bound, advertise=config.advertise, host=config.host
            )
            state.register_self(advertise, config.host or hostname(), os.getpid(), time.time())
            await service.persist()
            nursery.start_soon(service.watch_heartbeats)
    finally:
        store.close()


def main(config_path: str) -> int:
    config = load_config(config_path, MgmtdConfig)
    setup_logging("mgmtd", config.log_file, config.log_level)
    return run_service("mgmtd", lambda: serve(config))


def cli_main(args: argparse.Namespace) -> int:
    return main(args.config)
