#!/usr/bin/env python3
"""Where one remote 4 KiB read of the async client (what the FUSE mount runs)
spends its time: perf_counter_ns stamps at the entry of each layer, medians
over N reads, plus the client's CPU per read and an rpc ping for the floor.

    .venv/bin/python bench/read_breakdown.py --config C/client.toml --path /f

The file must exist (and should be warm on the storage side). Short-circuit
reads are off, so every read goes to a storage daemon even on its host. The
stamps patch the classes of this process only (a few hundred ns each).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import trio

from shufflefs.client import read_batcher, read_engine
from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.routing import RoutingCache
from shufflefs.rpc import client as rpc_client
from shufflefs.rpc import transport
from shufflefs.rpc.client import open_rpc_client

STAMPS: dict[str, int] = {}

# (class, method, stage that starts when it is entered), in call order
ENTRIES: list[tuple[Any, str, str]] = [
    (read_engine.ReadEngine, "read", "fs.read: file, extents, plan, buffer"),
    (read_engine.ReadJob, "round", "engine.read: job"),
    (read_engine.ReadJob, "request", "job.round: replica choice, grouping"),
    (read_batcher.ReadBatcher, "read", "job.request: timeouts, items"),
    (read_batcher.ReadBatcher, "_frame", "batcher.read: queue check"),
    (rpc_client.RpcClient, "request", "batcher._frame"),
    (rpc_client.PeerConnection, "request", "rpc.request: connection lookup"),
    (transport.FrameStream, "send_frame", "conn.request: waiter, deadline, msgpack"),
]


def stamp_entry(cls: Any, name: str, key: str) -> None:
    orig: Callable[..., Any] = getattr(cls, name)

    async def stamped(*args: Any, **kwargs: Any) -> Any:
        STAMPS.setdefault(key, time.perf_counter_ns())
        return await orig(*args, **kwargs)

    setattr(cls, name, stamped)


def stamp_reply() -> None:
    """Stamps when the frame is sent and when the reader task has decoded a reply."""
    send = transport.FrameStream.send_frame
    receive = transport.FrameStream.receive_frame

    async def send_frame(self: Any, body: bytes, payload: Any = None) -> None:
        await send(self, body, payload)
        STAMPS.setdefault("send_frame: pack, sendmsg", time.perf_counter_ns())

    async def receive_frame(self: Any) -> Any:
        got = await receive(self)
        STAMPS["wire: network, daemon, receive and decode"] = time.perf_counter_ns()
        return got

    transport.FrameStream.send_frame = send_frame  # type: ignore[method-assign]
    transport.FrameStream.receive_frame = receive_frame  # type: ignore[method-assign]


async def run(config: str, path: str, n: int) -> None:
    cfg, secret = load_client_config(config)
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        routing = RoutingCache(rpc, cfg.mgmtd)
        fs = FileSystem(rpc, routing, ClientOptions(local_reads=False))
        await fs.start(nursery)
        f, attr = await fs.open_path(path, os.O_RDONLY)
        blocks = max(1, attr["size"] // 4096)
        offsets = [random.randrange(blocks) * 4096 for _ in range(n)]
        for off in offsets[: n // 10]:  # warm: connections, caches
            await fs.read(f.fh, off, 4096)
        stages: dict[str, list[int]] = {}
        totals: list[int] = []
        cpu0 = time.process_time()
        for off in offsets:
            STAMPS.clear()
            t0 = time.perf_counter_ns()
            await fs.read(f.fh, off, 4096)
            t1 = time.perf_counter_ns()
            totals.append(t1 - t0)
            prev = t0
            for key, at in sorted(STAMPS.items(), key=lambda kv: kv[1]):
                stages.setdefault(key, []).append(at - prev)
                prev = at
            stages.setdefault("caller resumed, bytes in place", []).append(t1 - prev)
        cpu = (time.process_time() - cpu0) / n * 1e6
        address = next(iter(rpc._conns))
        pings = []
        for _ in range(n // 3):
            t0 = time.perf_counter_ns()
            await rpc.call(address, "ping")
            pings.append(time.perf_counter_ns() - t0)
        print(
            f"{n} reads of 4 KiB: p50 {statistics.median(totals) / 1e3:.1f} us, "
            f"client CPU {cpu:.1f} us per read"
        )
        for key, values in stages.items():
            print(f"  {key:<48} {statistics.median(values) / 1e3:7.1f} us")
        print(
            f"  {'rpc ping (answered inline) round trip':<48} "
            f"{statistics.median(pings) / 1e3:7.1f} us"
        )
        await fs.close()
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="client config of a running cluster")
    parser.add_argument("--path", required=True, help="a file in it (e.g. /f)")
    parser.add_argument("-n", type=int, default=3000, help="reads to time")
    args = parser.parse_args()
    for cls, name, key in ENTRIES:
        stamp_entry(cls, name, key)
    stamp_reply()
    trio.run(run, args.config, args.path, args.n)


if __name__ == "__main__":
    main()
