"""mgmtd's status page: one HTML page and the JSON it polls, beside ``/metrics``.

``/`` is a static page (`web_page.PAGE`: HTML and a little JavaScript, no
build step) that fetches ``/api/status`` every `web_page.REFRESH_MS` and
redraws: nodes with their state and live throughput, targets, chains,
capacity and running jobs. The JSON is built in the HTTP server's thread:
a snapshot of mgmtd's state taken on its event loop, then the nodes' and
mounts' metrics endpoints read in parallel (bounded by
`metrics_scrape.SCRAPE_TIMEOUT`) for rates since the previous poll.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from shufflefs.cluster.metrics import WsgiApp, start_metrics
from shufflefs.cluster.metrics_collectors import cluster_gauges, loop_snapshot
from shufflefs.cluster.metrics_registry import MetricsDirectory, MetricsEndpoint
from shufflefs.cluster.metrics_scrape import RateTracker
from shufflefs.cluster.protocol import Capacity, JobInfo, RoutingInfo
from shufflefs.cluster.web_page import PAGE
from shufflefs.rpc.client import RpcClient

StatusSnapshot = Callable[[], tuple[RoutingInfo, Capacity, list[MetricsEndpoint], list[JobInfo]]]


def status_document(
    routing: RoutingInfo,
    capacity: Capacity,
    endpoints: list[MetricsEndpoint],
    tracker: RateTracker,
    jobs: list[JobInfo],
) -> dict[str, Any]:
    urls = [e["url"] for e in endpoints]
    rates = tracker.sample(urls)
    by_node = {e["node"]: e["url"] for e in endpoints if e["node"] is not None}

    def live(url: str | None) -> dict[str, Any] | None:
        r = rates.get(url) if url else None
        return r.as_json() if r is not None else None

    nodes = [
        {**n, "metrics": by_node.get(n["id"]), "io": live(by_node.get(n["id"]))}
        for n in routing["nodes"]
    ]
    clients = [
        {"kind": e["kind"], "name": e["name"], "metrics": e["url"], "io": live(e["url"])}
        for e in endpoints
        if e["node"] is None
    ]
    return {
        "time": time.time(),
        "cluster_id": routing["cluster_id"],
        "version": routing["version"],
        "config": routing["config"],
        "capacity": capacity,
        "nodes": nodes,
        "clients": clients,
        "targets": routing["targets"],
        "chains": routing["chains"],
        "jobs": jobs,  # `shufflefs jobs`: drains, the rebalance, resyncs
    }


def _static(body: bytes, content_type: str) -> WsgiApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        start_response(
            "200 OK",
            [
                ("Content-Type", content_type),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [body]

    return app


def status_routes(snapshot: StatusSnapshot) -> dict[str, WsgiApp]:
    tracker = RateTracker()

    def api(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        routing, capacity, endpoints, jobs = snapshot()
        body = json.dumps(status_document(routing, capacity, endpoints, tracker, jobs)).encode()
        return _static(body, "application/json")(environ, start_response)

    return {"/": _static(PAGE.encode(), "text/html; charset=utf-8"), "/api/status": api}


async def start_web(
    nursery: trio.Nursery,
    address: str | None,
    *,
    routing: Callable[[], RoutingInfo],
    capacity: Callable[[], Capacity],
    jobs: Callable[[], list[JobInfo]],
    directory: MetricsDirectory,
    rpc: RpcClient,
    mgmtd: str,
    node: Callable[[], int | None],
) -> str | None:
    """mgmtd's one call: its status page, JSON and metrics at *address*,
    announced in its own directory like every other endpoint."""
    if not address:
        return None
    snapshot = loop_snapshot(lambda: (routing(), capacity()))
    status: StatusSnapshot = loop_snapshot(
        lambda: (routing(), capacity(), directory.endpoints(), jobs())
    )
    return await start_metrics(
        nursery,
        address,
        kind="mgmtd",
        rpc=rpc,
        mgmtd=mgmtd,
        node_id=node,
        collectors=[cluster_gauges(snapshot)],
        routes=status_routes(status),
    )
