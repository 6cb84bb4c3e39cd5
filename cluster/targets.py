"""`shufflefs target add --node ID PATH [--chain C]`: a new disk for a running cluster.

The storage node formats PATH as a target, keeps it across restarts (its
node state file lists it beside the config's targets) and registers it with
mgmtd; mgmtd then puts it into chain C, or into the chain whose offline
member has been offline longest (replacing that member if the chain is
full), at the tail as `syncing`. The storage daemon's resync copies the
chain's chunks to it, and it serves once it caught up. Without a chain to
join it stays a spare, from which new chains are built.
"""

from __future__ import annotations

import argparse
import errno
import json
import os

from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.nodes import cli_target_remove
from shufflefs.cluster.protocol import AssignResult, MgmtdStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import StorageStub

ADD_TIMEOUT = 60.0  # formatting a target creates its directories and database


async def add_target(
    mgmtd: MgmtdStub, rpc: RpcClient, node_id: int, path: str, chain: int | None
) -> tuple[int, AssignResult]:
    """Add *path* on storage node *node_id* as a target and assign it."""
    status = await mgmtd.status()
    node = next((n for n in status["nodes"] if n["id"] == node_id), None)
    if node is None or node["kind"] != "storage":
        raise FsError(errno.ENOENT, f"node {node_id} is not a storage node of this cluster")
    if node["state"] != "online":
        raise FsError(errno.EHOSTDOWN, f"storage node {node_id} is offline")
    if chain is not None and chain not in {c["id"] for c in status["chains"]}:
        raise FsError(errno.ENOENT, f"unknown chain {chain}")
    stub = StorageStub(rpc, node["address"], timeout=ADD_TIMEOUT)
    try:
        target_id = await stub.add_target(path)
    except FsError as exc:
        raise FsError(
            exc.code,
            f"storage node {node_id} at {node['address']} cannot add {path}: {exc.message}",
        ) from None
    try:
        return target_id, await mgmtd.assign_target(target_id, chain)
    except FsError as exc:
        if exc.code != errno.EEXIST:
            raise
    # registering it let mgmtd build a new chain from spares, this one included
    status = await mgmtd.status()
    joined = next(c["id"] for c in status["chains"] if target_id in c["targets"])
    state = next(t["state"] for t in status["targets"] if t["id"] == target_id)
    return target_id, {"chain": joined, "replaced": None, "state": state}


def cli_target(args: argparse.Namespace) -> int:
    """``shufflefs target add`` / ``remove``."""
    if args.target_command == "remove":
        return cli_target_remove(args)
    # the path is opened by the storage daemon: a relative one is taken
    # relative to this command's directory, as a user typing it means
    path = os.path.abspath(args.path)

    async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> tuple[int, AssignResult]:
        return await add_target(mgmtd, rpc, args.node, path, args.chain)

    target_id, result = with_mgmtd(args, run)
    if args.json:
        print(json.dumps({"target_id": target_id, "node": args.node, "path": path, **result}))
    elif result["chain"] is None:
        print(f"target {target_id} ({path} on node {args.node}) added as a spare")
    else:
        replaced = f", replacing offline target {result['replaced']}" if result["replaced"] else ""
        print(
            f"target {target_id} ({path} on node {args.node}) joined chain {result['chain']} "
            f"as {result['state']}{replaced}"
        )
    return 0
