"""Admin commands that talk to a running cluster: `shufflefs status`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from shufflefs.cluster.cli_errors import connect, explain_connection_error, innermost
from shufflefs.cluster.metrics_registry import MetricsEndpoint, endpoints
from shufflefs.cluster.preflight import load_client
from shufflefs.cluster.protocol import Capacity, MgmtdStub, RoutingInfo
from shufflefs.rpc.client import RpcClient, open_rpc_client
from shufflefs.rpc.errors import FsError

T = TypeVar("T")

CONNECT_TIMEOUT = 3.0
CALL_TIMEOUT = 5.0


def with_mgmtd(args: argparse.Namespace, fn: Callable[[MgmtdStub, RpcClient], Awaitable[T]]) -> T:
    """Run *fn* against the cluster named by --config / $SHUFFLEFS_CONFIG / the
    default. Failing to reach mgmtd is an `Unreachable` naming it and its
    address (refused, timeout, wrong secret, other protocol), not an answer."""
    config, secret = load_client(getattr(args, "config", None))

    async def run() -> T:
        async with open_rpc_client(
            secret, connect_timeout=CONNECT_TIMEOUT, call_timeout=CALL_TIMEOUT
        ) as rpc:
            await connect(rpc, "mgmtd", config.mgmtd)
            try:
                return await fn(MgmtdStub(rpc, config.mgmtd), rpc)
            except FsError as exc:
                raise explain_connection_error(
                    exc, "mgmtd", config.mgmtd, handshake=False
                ) from None

    try:
        return trio.run(run)
    except BaseExceptionGroup as group:  # the rpc client's nursery wraps what fn raised
        raise innermost(group) from None


def human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def render_status(status: RoutingInfo, capacity: Capacity, out: Any = sys.stdout) -> None:
    now = time.time()
    print(
        f"cluster {status['cluster_id']}  routing version {status['version']}  "
        f"replicas {status['config']['replicas']}  "
        f"chunk size {human(status['config']['chunk_size'])}",
        file=out,
    )
    print(
        f"capacity {human(capacity['capacity'])}, used {human(capacity['used'])}, "
        f"free {human(capacity['free'])}",
        file=out,
    )
    print("\nNODES", file=out)
    print(
        f"  {'id':>4}  {'kind':<8} {'state':<8} {'address':<22} {'host':<16} {'pid':>7}  last seen",
        file=out,
    )
    for n in status["nodes"]:
        ago = "now" if n["kind"] == "mgmtd" else f"{max(0.0, now - n['last_seen']):.1f}s ago"
        print(
            f"  {n['id']:>4}  {n['kind']:<8} {n['state']:<8} {n['address']:<22} {n['host']:<16} "
            f"{n['pid']:>7}  {ago}",
            file=out,
        )
    print("\nTARGETS", file=out)
    print(
        f"  {'id':>4}  {'node':>4}  {'state':<8} {'used':>10} {'free':>10} {'chunks':>8}  path",
        file=out,
    )
    for t in status["targets"]:
        full = "  FULL: writes get ENOSPC" if t["free"] <= 0 and t["state"] != "offline" else ""
        print(
            f"  {t['id']:>4}  {t['node']:>4}  {t['state']:<8} {human(t['used']):>10} "
            f"{human(t['free']):>10} {t['chunks']:>8}  {t['path']}{full}",
            file=out,
        )
    print("\nCHAINS", file=out)
    print(f"  {'id':>4}  {'version':>7}  targets (head first)", file=out)
    states = {t["id"]: t["state"] for t in status["targets"]}
    for c in status["chains"]:
        members = " -> ".join(f"{t}({states.get(t, '?')})" for t in c["targets"])
        print(f"  {c['id']:>4}  {c['version']:>7}  {members}", file=out)


def with_metrics(status: RoutingInfo, endpoints: list[MetricsEndpoint]) -> dict[str, Any]:
    """``status --json``: each node with its ``metrics`` URL (None when it
    serves none), ``web`` (mgmtd's status page, None when off) and the
    mounts' and clients' endpoints under ``clients``."""
    by_node = {e["node"]: e["url"] for e in endpoints if e["node"] is not None}
    nodes = [{**n, "metrics": by_node.get(n["id"])} for n in status["nodes"]]
    mgmtd_url = next((by_node.get(n["id"]) for n in status["nodes"] if n["kind"] == "mgmtd"), None)
    web = mgmtd_url.removesuffix("/metrics") + "/" if mgmtd_url else None
    clients = [
        {"kind": e["kind"], "name": e["name"], "metrics": e["url"]}
        for e in endpoints
        if e["node"] is None
    ]
    return {**status, "nodes": nodes, "web": web, "clients": clients}


def cli_status(args: argparse.Namespace) -> int:
    async def fetch(
        mgmtd: MgmtdStub, rpc: RpcClient
    ) -> tuple[RoutingInfo, Capacity, list[MetricsEndpoint]]:
        return await mgmtd.status(), await mgmtd.capacity(), await endpoints(rpc, mgmtd.address)

    status, capacity, found = with_mgmtd(args, fetch)
    if args.json:
        print(json.dumps({**with_metrics(status, found), "capacity": capacity}, indent=2))
    else:
        render_status(status, capacity)
        web = with_metrics(status, found)["web"]
        if web:
            print(f"\nstatus page {web}")
    return 0
