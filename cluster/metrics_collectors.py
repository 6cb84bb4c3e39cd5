"""Gauges read from a service's live state when its endpoint is scraped.

mgmtd reports the cluster as it sees it (nodes, target and chain states,
capacity); a storage daemon its own targets and running resyncs. Each
function returns what a scrape yields (`cluster.metrics.registry_of`).
mgmtd's state belongs to its event loop, so the scrape thread takes a
snapshot there (`trio.from_thread.run_sync`) rather than reading it mid-change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from shufflefs.cluster.protocol import Capacity, RoutingInfo

if TYPE_CHECKING:
    from shufflefs.storage.service import StorageService

T = TypeVar("T")

TARGET_STATES = ("serving", "syncing", "waiting", "offline")

Snapshot = Callable[[], tuple[RoutingInfo, Capacity]]


def loop_snapshot(fn: Callable[[], T]) -> Callable[[], T]:
    """*fn* run on the current trio loop, callable from any other thread."""
    token = trio.lowlevel.current_trio_token()
    return lambda: trio.from_thread.run_sync(fn, trio_token=token)


def cluster_gauges(snapshot: Snapshot) -> Callable[[], Iterable[Metric]]:
    def collect() -> Iterable[Metric]:
        routing, capacity = snapshot()
        yield GaugeMetricFamily(
            "shufflefs_routing_version", "Version of the routing map", value=routing["version"]
        )
        nodes = GaugeMetricFamily(
            "shufflefs_nodes", "Nodes known to mgmtd, by kind and state", labels=["kind", "state"]
        )
        for (kind, state), count in sorted(
            Counter((n["kind"], n["state"]) for n in routing["nodes"]).items()
        ):
            nodes.add_metric([kind, state], count)
        yield nodes
        up = GaugeMetricFamily(
            "shufflefs_node_up", "1 if the node is online", labels=["node", "kind", "address"]
        )
        for n in routing["nodes"]:
            up.add_metric([str(n["id"]), n["kind"], n["address"]], n["state"] == "online")
        yield up
        by_state = Counter(t["state"] for t in routing["targets"])
        targets = GaugeMetricFamily("shufflefs_targets", "Targets by state", labels=["state"])
        for state in TARGET_STATES:
            targets.add_metric([state], by_state.get(state, 0))
        yield targets
        target_state = GaugeMetricFamily(
            "shufflefs_target_state",
            "1 for the state each target is in",
            labels=["target", "node", "state"],
        )
        figures = {
            key: GaugeMetricFamily(
                f"shufflefs_target_{key}{unit}",
                f"Target {key}, as last heartbeated",
                labels=["target", "node"],
            )
            for key, unit in (
                ("capacity", "_bytes"),
                ("free", "_bytes"),
                ("used", "_bytes"),
                ("chunks", ""),
            )
        }
        for t in routing["targets"]:
            labels = [str(t["id"]), str(t["node"])]
            for state in TARGET_STATES:
                target_state.add_metric([*labels, state], t["state"] == state)
            for key, family in figures.items():
                family.add_metric(labels, t[key])  # type: ignore[literal-required]
        yield target_state
        yield from figures.values()
        states = {t["id"]: t["state"] for t in routing["targets"]}
        serving = GaugeMetricFamily(
            "shufflefs_chain_serving_replicas", "Serving members per chain", labels=["chain"]
        )
        members = GaugeMetricFamily(
            "shufflefs_chain_replicas", "Members per chain (any state)", labels=["chain"]
        )
        for c in routing["chains"]:
            serving.add_metric(
                [str(c["id"])], sum(states.get(t) == "serving" for t in c["targets"])
            )
            members.add_metric([str(c["id"])], len(c["targets"]))
        yield serving
        yield members
        for key in ("capacity", "free", "used"):
            yield GaugeMetricFamily(
                f"shufflefs_cluster_{key}_bytes",
                f"Cluster {key} over the serving targets",
                value=capacity[key],  # type: ignore[literal-required]
            )

    return collect


def storage_gauges(service: StorageService) -> Callable[[], Iterable[Metric]]:
    def collect() -> Iterable[Metric]:
        usage = service.capacity.usage()
        for key, unit, what in (
            ("capacity", "_bytes", "Size of the filesystem the target lives on"),
            ("free", "_bytes", "Bytes still available to the target, after its reserve"),
            ("used", "_bytes", "Bytes of chunk data the target holds"),
            ("chunks", "", "Chunks the target holds"),
        ):
            family = GaugeMetricFamily(
                f"shufflefs_storage_target_{key}{unit}", what, labels=["target"]
            )
            for u in usage:
                family.add_metric([str(u["target_id"])], u[key])  # type: ignore[literal-required]
            yield family
        yield GaugeMetricFamily(
            "shufflefs_resync_running",
            "Targets of this node being resynced now",
            value=len(service.resyncer.running),
        )

    return collect
