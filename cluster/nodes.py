"""`shufflefs node drain|remove ID` and `shufflefs target remove ID`
(mgmtd does the work: `cluster/drain.py`)."""

from __future__ import annotations

import argparse
import errno
import json
import time

import trio

from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.progress import Progress, poll
from shufflefs.cluster.protocol import MgmtdStub, RoutingInfo
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

POLL = 0.5  # seconds between looks at a drain's progress


def chains_left(status: RoutingInfo, node_id: int) -> list[int]:
    mine = {t["id"] for t in status["targets"] if t["node"] == node_id}
    return [c["id"] for c in status["chains"] if mine & set(c["targets"])]


async def drain(mgmtd: MgmtdStub, node_id: int, wait: float | None) -> dict[str, object]:
    chains = await mgmtd.drain_node(node_id)
    left = chains
    if wait is not None:
        deadline = trio.current_time() + wait
        with Progress(f"drain-{node_id}", "chains") as progress:
            while left:
                progress.show(len(chains) - len(left), len(chains))
                if trio.current_time() > deadline:
                    raise FsError(
                        errno.ETIMEDOUT,
                        f"node {node_id} still in chains {left} after {wait:g}s "
                        "(the drain goes on; see `shufflefs jobs`)",
                    )
                await trio.sleep(POLL)
                status = await poll(mgmtd.status)
                if status is None:
                    continue  # mgmtd restarting: look again
                node = next((n for n in status["nodes"] if n["id"] == node_id), None)
                left = chains_left(status, node_id)
                if left and node is not None and not node.get("draining"):
                    raise FsError(
                        errno.ECANCELED,
                        f"the drain of node {node_id} was cancelled; it stays in chains {left}",
                    )
            progress.show(len(chains), len(chains))
    return {"node": node_id, "chains": chains, "left": left, "drained": not left}


def cli_node(args: argparse.Namespace) -> int:
    """``shufflefs node drain|remove ID``."""
    if args.node_command == "drain":
        started = time.monotonic()

        async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> dict[str, object]:
            return await drain(mgmtd, args.id, args.timeout if args.wait else None)

        result = with_mgmtd(args, run)
        if args.json:
            print(json.dumps(result))
        elif result["drained"]:
            print(
                f"node {args.id} drained in {time.monotonic() - started:.1f}s: "
                f"`shufflefs node remove {args.id}` takes it out"
            )
        else:
            print(
                f"node {args.id} draining: leaves chains {result['chains']} "
                "(progress in `shufflefs status`; `--wait` waits)"
            )
        return 0

    async def remove(mgmtd: MgmtdStub, rpc: RpcClient) -> None:
        await mgmtd.remove_node(args.id)

    with_mgmtd(args, remove)
    print(
        json.dumps({"node": args.id, "removed": True}) if args.json else f"node {args.id} removed"
    )
    return 0


def cli_target_remove(args: argparse.Namespace) -> int:
    async def remove(mgmtd: MgmtdStub, rpc: RpcClient) -> None:
        await mgmtd.remove_target(args.id)

    with_mgmtd(args, remove)
    print(
        json.dumps({"target": args.id, "removed": True})
        if args.json
        else f"target {args.id} removed"
    )
    return 0
