#!/usr/bin/env python3
"""Metadata mutations per second: N concurrent in-process clients, each with
its own rpc connection, creating files through the real `MetaService` over
rpc on loopback, with durable commits (`sync = true`).

    .venv/bin/python bench/meta_mutations.py --clients 1 8 64 --seconds 3

The namespace lives under --dir (default: a new directory in /var/tmp, on
the disk, not tmpfs, so each commit's fsync costs what it costs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import trio

from shufflefs.cluster.protocol import RoutingInfo
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.server import MetaService
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import RpcServer, open_rpc_client

SECRET = os.urandom(32)


def routing_info() -> RoutingInfo:
    """One storage node with three chains: enough for layouts (the bench
    creates files; no storage call is made)."""
    return {
        "version": 1,
        "cluster_id": "bench",
        "config": {
            "chunk_size": 1 << 20,
            "stripe": 1,
            "replicas": 1,
            "min_replicas": 1,
            "heartbeat_interval": 1.0,
            "heartbeat_timeout": 5.0,
        },
        "nodes": [],
        "targets": [
            {
                "id": t,
                "node": 1,
                "path": f"/t{t}",
                "state": "serving",
                "capacity": 1 << 40,
                "free": 1 << 40,
                "used": 0,
                "chunks": 0,
            }
            for t in (1, 2, 3)
        ],
        "chains": [{"id": t, "version": 1, "targets": [t]} for t in (1, 2, 3)],
    }


async def run(path: Path, clients: int, seconds: float) -> dict[str, float]:
    store = NamespaceStore(path, map_size=1 << 30, sync=True)
    routing = Routing(routing_info())
    done = 0
    try:
        async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
            service = MetaService(store, lambda: routing, rpc)
            port = await nursery.start(
                RpcServer(SECRET, [service], name="meta").serve, "127.0.0.1", 0
            )
            address = f"127.0.0.1:{port}"
            commits0 = store.txns.commit_count
            deadline = trio.current_time() + seconds

            async def client(i: int) -> None:
                nonlocal done
                async with open_rpc_client(SECRET) as own:
                    meta = MetaStub(own, address)
                    session = (await meta.session_open(f"bench{i}", "localhost", i + 1))["session"]
                    d = (await meta.mkdir(ROOT_INODE, f"c{i}".encode(), 0o755, 0, 0))["ino"]
                    n = 0
                    while trio.current_time() < deadline:
                        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
                        await meta.create(d, b"f%08d" % n, 0o644, flags, 0, 0, session)
                        n += 1
                    done += n

            t0 = time.perf_counter()
            async with trio.open_nursery() as inner:
                for i in range(clients):
                    inner.start_soon(client, i)
            elapsed = time.perf_counter() - t0
            commits = store.txns.commit_count - commits0
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    return {
        "clients": clients,
        "creates": done,
        "seconds": round(elapsed, 2),
        "creates_per_s": round(done / elapsed, 1),
        "commits": commits,
        "creates_per_commit": round(done / max(1, commits), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="meta-bench-", dir=args.dir or "/var/tmp"))
    try:
        for n in args.clients:
            row = trio.run(run, base / f"ns{n}", n, args.seconds)
            if args.json:
                print(json.dumps(row))
            else:
                print(
                    f"{n:3d} clients: {row['creates_per_s']:8.1f} creates/s "
                    f"({row['creates']} in {row['seconds']} s, {row['commits']} commits, "
                    f"{row['creates_per_commit']} creates/commit)"
                )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)


if __name__ == "__main__":
    main()
