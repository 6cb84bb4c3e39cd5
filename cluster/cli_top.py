"""`shufflefs top`: a live view of IOPS, throughput and latency per node and per mount.

Like ``juicefs stats``: every ``--interval`` seconds it reads each
endpoint mgmtd's directory lists (storage and metadata servers, mgmtd,
mounts, native clients with metrics on) and prints the rates since the
previous read (`metrics_scrape`), redrawing the screen on a terminal.
``--count N`` stops after N refreshes; ``--json`` prints one JSON object
per refresh (one line each). An endpoint that does not answer shows ``-``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from shufflefs.cluster.admin import human, with_mgmtd
from shufflefs.cluster.metrics_registry import MetricsEndpoint, endpoints
from shufflefs.cluster.metrics_scrape import RateTracker
from shufflefs.cluster.protocol import MgmtdStub, RoutingInfo
from shufflefs.rpc.client import RpcClient

CLEAR = "\x1b[H\x1b[2J"


def lookup(args: argparse.Namespace) -> tuple[RoutingInfo, list[MetricsEndpoint]]:
    async def fetch(mgmtd: MgmtdStub, rpc: RpcClient) -> tuple[RoutingInfo, list[MetricsEndpoint]]:
        return await mgmtd.status(), await endpoints(rpc, mgmtd.address)

    return with_mgmtd(args, fetch)


def rows(
    routing: RoutingInfo, found: list[MetricsEndpoint], tracker: RateTracker
) -> list[dict[str, Any]]:
    rates = tracker.sample([e["url"] for e in found])
    nodes = {n["id"]: n for n in routing["nodes"]}
    out = []
    for e in found:
        node = nodes.get(e["node"]) if e["node"] is not None else None
        r = rates.get(e["url"])
        out.append(
            {
                "kind": e["kind"],
                "node": e["node"],
                "name": node["address"] if node else e["name"],
                "state": node["state"] if node else "online",
                "metrics": e["url"],
                **(r.as_json() if r is not None else {"iops": None}),
            }
        )
    return out


def render(table: list[dict[str, Any]], interval: float, out: TextIO) -> None:
    print(
        f"shufflefs top  {time.strftime('%H:%M:%S')}  (rates over {interval:g}s)\n\n"
        f"{'kind':<8} {'node':>4}  {'name':<24} {'IOPS':>9} {'read/s':>11} {'write/s':>11} "
        f"{'latency':>10} {'err/s':>6}",
        file=out,
    )
    for row in table:
        node = "" if row["node"] is None else str(row["node"])
        if row["iops"] is None:
            figures = f"{'-':>9} {'-':>11} {'-':>11} {'-':>10} {'-':>6}"
        else:
            latency = "-" if row["latency_ms"] is None else f"{row['latency_ms']:.2f}ms"
            figures = (
                f"{row['iops']:>9.0f} {human(row['read_bytes_per_s']) + '/s':>11} "
                f"{human(row['write_bytes_per_s']) + '/s':>11} {latency:>10} "
                f"{row['errors_per_s']:>6.1f}"
            )
        print(f"{row['kind']:<8} {node:>4}  {row['name'][:24]:<24} {figures}", file=out)
    totals = [r for r in table if r["iops"] is not None and r["kind"] == "storage"]
    print(
        f"\nstorage total: {sum(r['iops'] for r in totals):.0f} IOPS, "
        f"{human(sum(r['read_bytes_per_s'] for r in totals))}/s read, "
        f"{human(sum(r['write_bytes_per_s'] for r in totals))}/s written",
        file=out,
    )


def cli_top(args: argparse.Namespace) -> int:
    """``shufflefs top [--interval S] [--count N] [--json]``."""
    tracker = RateTracker()
    routing, found = lookup(args)
    rows(routing, found, tracker)  # the first read: rates start from here
    screen = sys.stdout.isatty() and not args.json
    shown = 0
    while args.count is None or shown < args.count:
        time.sleep(args.interval)
        routing, found = lookup(args)  # nodes and mounts come and go
        table = rows(routing, found, tracker)
        shown += 1
        if args.json:
            print(json.dumps({"time": time.time(), "interval": args.interval, "rows": table}))
        else:
            if screen:
                sys.stdout.write(CLEAR)
            render(table, args.interval, sys.stdout)
            if not screen:
                print()
        sys.stdout.flush()
    return 0
