"""`shufflefs meta add`: one more metadata server in a local group.

The configs are written by `LocalCluster.add_meta_server`, the server is
started the way `up` starts what is missing, and the command waits until
the new server follows the primary and has caught up with it (the primary
sends it a snapshot of the namespace, then the log: docs/metadata.md,
"Catch-up"). On a real cluster there is nothing to run here: start a
metadata server on the new host with `group_size` one higher (docs/
operations.md, "Deploying three hosts"); it registers, and the group
counts it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import trio

from shufflefs.cluster import lifecycle
from shufflefs.cluster.cli_errors import UsageError
from shufflefs.cluster.launcher import LocalCluster
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.rpc import open_rpc_client
from shufflefs.rpc.cluster_secret import load_secret
from shufflefs.rpc.errors import FsError

POLL = 0.25


def meta_nodes(cluster: LocalCluster) -> list[dict[str, Any]]:
    """The metadata servers in mgmtd's routing map."""
    layout = cluster.layout()

    async def fetch() -> list[dict[str, Any]]:
        async with open_rpc_client(load_secret(cluster.secret_file)) as rpc:
            status = await MgmtdStub(rpc, layout.mgmtd_address).status()
        return [dict(n) for n in status["nodes"] if n["kind"] == "meta"]

    return trio.run(fetch)


def wait_caught_up(cluster: LocalCluster, address: str, timeout: float) -> dict[str, Any]:
    """The new server's node entry once it follows and has the primary's position."""
    deadline = time.monotonic() + timeout
    last = "not registered yet"
    while time.monotonic() < deadline:
        try:
            metas = meta_nodes(cluster)
        except FsError as exc:
            last = f"mgmtd: {exc.message}"
        else:
            new = next((n for n in metas if n["address"] == address), None)
            lead = next((n for n in metas if n.get("role") == "primary"), None)
            if new is not None and lead is not None:
                last = (
                    f"{new.get('role', '?')} at seq {new.get('applied_seq', 0)}, "
                    f"the primary at {lead.get('applied_seq', 0)}"
                )
                if new.get("role") == "follower" and new.get("applied_seq", 0) >= lead.get(
                    "applied_seq", 0
                ):
                    return new
        time.sleep(POLL)
    raise UsageError(f"the new metadata server did not catch up in {timeout:g}s ({last})")


def cli_meta_add(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args.data_dir)
    name = cluster.add_meta_server()
    layout = cluster.layout()
    address = layout.meta_address(layout.meta_servers)
    with open(os.devnull, "w") as quiet:
        lifecycle.up(args.data_dir, None, out=quiet)
    node = wait_caught_up(cluster, address, args.timeout)
    result = {
        "name": name,
        "address": address,
        "meta_servers": layout.meta_servers,
        "role": node.get("role"),
        "applied_seq": node.get("applied_seq", 0),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"added {name} at {address}: {result['role']}, caught up at seq "
            f"{result['applied_seq']}; the group has {layout.meta_servers} metadata servers"
        )
    return 0
