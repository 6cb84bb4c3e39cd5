"""The metadata server process: open the namespace, serve rpc (the
namespace's `server.MetaService` and the followers' side of log shipping,
`replication.ReplicationService`), join the cluster, and take the primary's
role when mgmtd grants the lease (`replication_role.MetaRole`)."""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster.agent import NodeAgent, unregister_node
from shufflefs.cluster.metrics import start_metrics
from shufflefs.cluster.node import NodeState, advertised_address, listen_address
from shufflefs.cluster.protocol import MgmtdStub, RegisterResult
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.config import MetaConfig
from shufflefs.metadata.follower_reads import ReadPosition
from shufflefs.metadata.replication import ReplicationService
from shufflefs.metadata.replication_role import LEASE_REQUEST_TIMEOUT, MetaRole
from shufflefs.metadata.replication_snapshot import SnapshotReceiver, send_snapshot
from shufflefs.metadata.server import MetaService
from shufflefs.metadata.store import NamespaceStore
from shufflefs.rpc.addresses import hostname
from shufflefs.rpc.client import open_rpc_client
from shufflefs.rpc.cluster_secret import load_secret
from shufflefs.rpc.config import load_config
from shufflefs.rpc.runtime import run_service, setup_logging
from shufflefs.rpc.server import RpcServer

log = logging.getLogger("shufflefs.metadata.server")

NAMESPACE_DIR = "namespace"


def _save_node_state(node: NodeState, data_dir: Path, result: RegisterResult) -> None:
    """Keep the ids across restarts: the node rejoins as itself, and mgmtd
    refuses it if the data dir belongs to another cluster."""
    node.node_id, node.cluster_id = result["node_id"], result["cluster_id"]
    node.save(data_dir)


async def serve(config: MetaConfig, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run a metadata server until cancelled: open the namespace, serve rpc,
    join the cluster, carry out storage jobs; on the way out, leave the
    cluster cleanly and close the namespace. Reports the advertised address
    through *task_status* once registered."""
    config.validate("metadata server config")
    secret = load_secret(Path(config.secret_file))
    data_dir = Path(config.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    host, port = listen_address(config.listen)
    node = NodeState.load(data_dir)
    store = NamespaceStore(
        data_dir / NAMESPACE_DIR,
        map_size=config.map_size,
        sync=config.sync,
        session_timeout=config.session_timeout,
    )
    try:
        counts = store.counts()
        sessions = counts["sessions"]
        log.info(
            "namespace opened path=%s inodes=%d sessions=%d handles=%d gc_jobs=%d truncate_jobs=%d",
            store.path,
            counts["inodes"],
            sessions,
            counts["handles"],
            counts["gc"],
            counts["truncates"],
        )
        async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
            cache = RoutingCache(rpc, config.mgmtd)
            agent: NodeAgent | None = None
            role = MetaRole(
                store.txns,
                rpc,
                MgmtdStub(rpc, config.mgmtd, timeout=LEASE_REQUEST_TIMEOUT),
                group_size=config.group_size,
                log_keep=config.log_keep,
                routing=lambda: cache.current,
                node_id=lambda: agent.node_id if agent is not None else None,
                resync=lambda address, epoch: send_snapshot(store, rpc, address, epoch),
            )
            service = MetaService(
                store, lambda: cache.current, rpc, refresh_routing=cache.refresh, role=role
            )
            service.jobs.attach(cache)
            replication = ReplicationService(
                store.txns,
                epoch_seen=role.epoch_seen,
                may_follow=role.may_follow,
                snapshots=SnapshotReceiver(store),
            )
            server = RpcServer(
                secret,
                [service, replication],
                name="meta",
                position=ReadPosition(store.txns, role, replication),
            )
            bound = await nursery.start(server.serve, host, port)
            address = advertised_address(host, bound, advertise=config.advertise, host=config.host)

            async def routing_changed(version: int) -> None:
                await cache.refresh(min_version=version)

            agent = NodeAgent(
                MgmtdStub(rpc, config.mgmtd),
                kind="meta",
                address=address,
                host=config.host or hostname(),
                cluster_id=node.cluster_id,
                node_id=node.node_id,
                on_registered=functools.partial(_save_node_state, node, data_dir),
                on_routing_version=routing_changed,
            )
            try:
                await nursery.start(agent.run)
                routing = await cache.start(nursery)
                agent.interval = routing.config["heartbeat_interval"]
                await nursery.start(service.run_background)
                await start_metrics(
                    nursery,
                    config.metrics,
                    kind="meta",
                    rpc=rpc,
                    mgmtd=config.mgmtd,
                    node_id=lambda: agent.node_id if agent is not None else None,
                )
                log.info(
                    "metadata server ready address=%s node=%s cluster=%s",
                    address,
                    agent.node_id,
                    agent.cluster_id,
                )
                task_status.started(address)
                await trio.sleep_forever()
            finally:
                if agent.registered.is_set() and agent.node_id is not None:
                    with trio.CancelScope(shield=True):
                        await unregister_node(secret, config.mgmtd, agent.node_id)
    finally:
        store.close()


def main(config_path: str) -> int:
    config = load_config(config_path, MetaConfig)
    setup_logging("meta", config.log_file, config.log_level)
    return run_service("meta", functools.partial(serve, config))


def cli_main(args: argparse.Namespace) -> int:
    """`shufflefs meta --config FILE`."""
    return main(args.config)
