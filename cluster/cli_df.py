"""`shufflefs df`: capacity, use and free space per target, per node and in total.

The figures are the ones storage daemons heartbeat to mgmtd (refreshed every
second); ``use%`` is of the filesystem a target lives on, as df(1) has it
(other files on the disk count). The total is mgmtd's: over serving targets, each filesystem counted
once however many targets share it (what `statfs` on a mount reports).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from shufflefs.cluster.admin import human, with_mgmtd
from shufflefs.cluster.protocol import Capacity, MgmtdStub, RoutingInfo
from shufflefs.rpc.client import RpcClient


def percent(used: int, capacity: int) -> float:
    return round(100.0 * used / capacity, 1) if capacity else 0.0


def usage_report(routing: RoutingInfo, capacity: Capacity) -> dict[str, Any]:
    nodes = {n["id"]: n for n in routing["nodes"]}
    targets: list[dict[str, Any]] = [
        {
            "id": t["id"],
            "node": t["node"],
            "host": nodes[t["node"]]["host"] if t["node"] in nodes else None,
            "state": t["state"],
            "path": t["path"],
            "capacity": t["capacity"],
            "used": t["used"],
            "free": t["free"],
            "chunks": t["chunks"],
            "use_percent": percent(t["capacity"] - t["free"], t["capacity"]),
        }
        for t in routing["targets"]
    ]
    per_node: dict[int, dict[str, Any]] = {}
    for t in targets:
        n = per_node.setdefault(
            t["node"],
            {
                "id": t["node"],
                "host": t["host"],
                "state": nodes[t["node"]]["state"] if t["node"] in nodes else "unknown",
                "targets": 0,
                "capacity": 0,
                "used": 0,
                "free": 0,
                "chunks": 0,
            },
        )
        n["targets"] += 1
        for key in ("capacity", "used", "free", "chunks"):
            n[key] += t[key]
    for n in per_node.values():
        n["use_percent"] = percent(n["capacity"] - n["free"], n["capacity"])
    total = {
        **capacity,
        "use_percent": percent(capacity["capacity"] - capacity["free"], capacity["capacity"]),
    }
    return {
        "targets": targets,
        "nodes": sorted(per_node.values(), key=lambda n: n["id"]),
        "total": total,
    }


def render(report: dict[str, Any], out: TextIO) -> None:
    head = f"{'capacity':>10} {'used':>10} {'free':>10} {'use%':>5}"

    def figures(x: dict[str, Any]) -> str:
        return (
            f"{human(x['capacity']):>10} {human(x['used']):>10} {human(x['free']):>10} "
            f"{x['use_percent']:>4.0f}%"
        )

    print(f"{'target':>6} {'node':>4} {'state':<8} {head} {'chunks':>8}  path", file=out)
    for t in report["targets"]:
        print(
            f"{t['id']:>6} {t['node']:>4} {t['state']:<8} {figures(t)} {t['chunks']:>8}  "
            f"{t['path']}",
            file=out,
        )
    print(f"\n{'node':>6} {'host':<16} {'state':<8} {head} {'targets':>7}", file=out)
    for n in report["nodes"]:
        print(
            f"{n['id']:>6} {n['host'] or '?':<16} {n['state']:<8} {figures(n)} {n['targets']:>7}",
            file=out,
        )
    print(f"\n{'total':<32} {figures(report['total'])}", file=out)


def cli_df(args: argparse.Namespace) -> int:
    """``shufflefs df [--json]``."""

    async def fetch(mgmtd: MgmtdStub, rpc: RpcClient) -> tuple[RoutingInfo, Capacity]:
        return await mgmtd.status(), await mgmtd.capacity()

    report = usage_report(*with_mgmtd(args, fetch))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, sys.stdout)
    return 0
