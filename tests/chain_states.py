"""mgmtd's ClusterState without processes, for the placement, drain and
rebalance unit tests: a cluster config and storage nodes registering."""

from __future__ import annotations

from shufflefs.cluster.protocol import ClusterConfig
from shufflefs.cluster.state import ClusterState


def cluster(initial_nodes: int) -> ClusterState:
    return ClusterState.new(
        ClusterConfig(
            chunk_size=1 << 20,
            stripe=16,
            replicas=3,
            min_replicas=2,
            heartbeat_interval=1.0,
            heartbeat_timeout=10.0,
            initial_nodes=initial_nodes,
        )
    )


def register(state: ClusterState, node: int, targets: int) -> None:
    state.register(
        None,
        "storage",
        f"127.0.0.1:{9000 + node}",
        f"host{node}",
        100 + node,
        None,
        [
            {
                "target_id": None,
                "path": f"/d{node}/t{k}",
                "capacity": 1 << 30,
                "free": 1 << 30,
                "device": node,
            }
            for k in range(targets)
        ],
        0.0,
    )
