"""Admin commands that talk to a running cluster: `shufflefs status` (mgmtd's
view, and the mounts the metadata server has sessions of)."""

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
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import SessionInfo
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.addresses import mgmtd_addresses
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
            await connect_any(rpc, mgmtd_addresses(config.mgmtd))
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


async def connect_any(rpc: RpcClient, addresses: list[str]) -> None:
    """Reach one mgmtd instance of the list (HA: any of them will do, the
    stub finds the primary); the last failure if none answers."""
    for i, address in enumerate(addresses):
        try:
            await connect(rpc, "mgmtd", address)
            return
        except FsError:
            if i == len(addresses) - 1:
                raise


async def mgmtd_roles(mgmtd: MgmtdStub, rpc: RpcClient) -> list[dict[str, Any]]:
    """Each configured mgmtd instance's role (`unreachable` if it does not answer)."""
    out: list[dict[str, Any]] = []
    for address in mgmtd.addresses:
        try:
            out.append(dict(await MgmtdStub(rpc, address, timeout=2.0).role()))
        except FsError as exc:
            out.append({"address": address, "role": "unreachable", "error": exc.message})
    return out


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
    in_chains = {t for c in status["chains"] for t in c["targets"]}
    node_in_chains = {t["node"] for t in status["targets"] if t["id"] in in_chains}
    for n in status["nodes"]:
        ago = "now" if n["kind"] == "mgmtd" else f"{max(0.0, now - n['last_seen']):.1f}s ago"
        if n.get("replacing"):  # dead for `replace_offline_after`
            ago += "  re-replicating (see `shufflefs jobs`)"
        elif n.get("draining"):  # `shufflefs node drain`
            ago += "  draining" if n["id"] in node_in_chains else "  drained (remove it)"
        role = f"  {n['role']}" if "role" in n else ""
        if n["kind"] == "meta" and "role" in n:
            role += f" epoch {n.get('epoch', 0)} applied {n.get('applied_seq', 0)}"
        print(
            f"  {n['id']:>4}  {n['kind']:<8} {n['state']:<8} {n['address']:<22} {n['host']:<16} "
            f"{n['pid']:>7}  {ago}{role}",
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


def render_mounts(sessions: list[SessionInfo] | str, out: Any = sys.stdout) -> None:
    print("\nMOUNTS", file=out)
    if isinstance(sessions, str):
        print(f"  (not known: {sessions})", file=out)
        return
    print(
        f"  {'session':>7}  {'host':<16} {'pid':>7}  {'mode':<9} {'attr':>6} {'entry':>6} "
        f"{'negative':>8} {'linger':>6}  mountpoint",
        file=out,
    )
    for s in sessions:
        m = s["mount"]
        if m is None:
            continue
        print(
            f"  {s['session']:>7}  {s['host']:<16} {s['pid']:>7}  {m['mode']:<9} "
            f"{m['attr_timeout']:>5g}s {m['entry_timeout']:>5g}s {m['negative_timeout']:>7g}s "
            f"{m['handle_linger']:>5g}s  {m['mountpoint']}",
            file=out,
        )


async def fetch_sessions(rpc: RpcClient, status: RoutingInfo) -> list[SessionInfo] | str:
    """The metadata server's live sessions, or why they are not known (the
    rest of the status is still worth showing when it is down)."""
    try:
        address = Routing(status).meta_address()
        return await MetaStub(rpc, address, CALL_TIMEOUT).sessions()
    except FsError as exc:
        return exc.message


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
    ) -> tuple[
        RoutingInfo, Capacity, list[dict[str, Any]], list[SessionInfo] | str, list[MetricsEndpoint]
    ]:
        status = await mgmtd.status()
        capacity = await mgmtd.capacity()
        roles = await mgmtd_roles(mgmtd, rpc)
        sessions = await fetch_sessions(rpc, status)
        return status, capacity, roles, sessions, await endpoints(rpc, mgmtd.address)

    status, capacity, roles, sessions, found = with_mgmtd(args, fetch)
    primary = next((r["address"] for r in roles if r["role"] == "primary"), None)
    for n in status["nodes"]:
        if n["kind"] == "mgmtd":  # the primary's entry (standbys are in "mgmtd")
            n["role"] = "primary" if primary in (None, n["address"]) else "standby"
    document = with_metrics(status, found)
    if args.json:
        mounts: list[dict[str, Any]] | None = None
        if not isinstance(sessions, str):
            mounts = [
                {**s["mount"], "session": s["session"], "host": s["host"], "pid": s["pid"]}
                for s in sessions
                if s["mount"] is not None
            ]
        document.update(capacity=capacity, mgmtd=roles, mounts=mounts)
        print(json.dumps(document, indent=2))
    else:
        render_status(status, capacity)
        print("\nMGMTD", file=sys.stdout)
        for r in roles:
            print(f"  {r['address']:<22} {r['role']}", file=sys.stdout)
        render_mounts(sessions)
        if document["web"]:
            print(f"\nstatus page {document['web']}")
    return 0
