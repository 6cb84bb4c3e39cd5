#!/usr/bin/env python3
"""A metadata group of N servers (`shufflefs up --meta-servers N`, real
processes, durable commits): create latency at C concurrent clients;
read-only operations per second (lookup + getattr through `MetaClient`,
spread over every server of the group as the mount spreads them) from
--read-procs client processes; then the failover stall: kill -9 of the
primary while one client creates files in a row (retried through
`MetaClient`, as the mount does): the longest create, and the time from
the kill until creates flowed again. With --ha (`up --ha`: 3 etcd members,
3 mgmtd) the mgmtd primary is killed the same way first.

    .venv/bin/python bench/meta_group.py --meta-servers 1 3 --clients 1 8 --seconds 3
    .venv/bin/python bench/meta_group.py --ha --meta-servers 3 --clients 8 --read-procs 0

The cluster lives under --dir (default: a new directory in /var/tmp, on
disk, so each commit's fsync costs what it costs) and is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from shufflefs.client.meta_client import MetaClient
from shufflefs.cluster import lifecycle, procs
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.launcher import LocalCluster, mgmtd_name
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import ROOT_INODE, Attr
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import open_rpc_client
from shufflefs.rpc.retry import retrying

FLAGS = os.O_CREAT | os.O_EXCL | os.O_WRONLY
KILL_WINDOW = 8.0  # seconds the creates go on after a kill


async def measure(
    data_dir: Path, clients: int, seconds: float, kills: tuple[str, ...]
) -> dict[str, Any]:
    config, secret = load_client_config(data_dir / "client.toml")
    mgmtd_address = config.mgmtd
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        cache = RoutingCache(rpc, mgmtd_address, poll_interval=0.2)
        await cache.start(nursery)
        address = cache.current.meta_address()
        latencies: list[float] = []
        deadline = trio.current_time() + seconds

        async def client(i: int) -> None:
            async with open_rpc_client(secret) as own:
                meta = MetaStub(own, address)
                # right after `up` the primary may be a moment from taking writes
                opened = await retrying(
                    "session_open", lambda: meta.session_open(f"b{i}", "localhost", i), budget=10
                )
                session = opened["session"]
                d = (await meta.mkdir(ROOT_INODE, b"c%d-%d" % (clients, i), 0o755, 0, 0))["ino"]
                n = 0
                while trio.current_time() < deadline:
                    t0 = time.perf_counter()
                    await meta.create(d, b"f%08d" % n, 0o644, FLAGS, 0, 0, session)
                    latencies.append(time.perf_counter() - t0)
                    n += 1

        async with trio.open_nursery() as inner:
            for i in range(clients):
                inner.start_soon(client, i)
        row: dict[str, Any] = {
            "clients": clients,
            "creates_per_s": round(len(latencies) / seconds, 1),
            "latency_ms_median": round(statistics.median(latencies) * 1000, 2),
            "latency_ms_p99": round(sorted(latencies)[int(len(latencies) * 0.99)] * 1000, 2),
        }
        for which in kills:
            row.update(await failover(rpc, cache, mgmtd_address, data_dir, which))
        nursery.cancel_scope.cancel()
    return row


async def primary_pid(rpc: Any, data_dir: Path, mgmtd_address: str, which: str) -> int:
    """The pid of the metadata primary (*which* "meta") or the mgmtd primary."""
    if which == "meta":
        status = await MgmtdStub(rpc, mgmtd_address).status()
        meta = next(n for n in status["nodes"] if n["kind"] == "meta" and n["role"] == "primary")
        return int(meta["pid"])
    cluster = LocalCluster(data_dir)
    layout = cluster.layout()
    for i, port in enumerate([layout.mgmtd_port, *layout.mgmtd_ports], start=1):
        address = f"{layout.host}:{port}"
        if (await MgmtdStub(rpc, address).role())["role"] == "primary":
            pid = procs.running_pid(next(s for s in cluster.services() if s.name == mgmtd_name(i)))
            assert pid is not None
            return pid
    raise RuntimeError("no mgmtd primary")


async def meta_epoch(rpc: Any, mgmtd_address: str) -> int:
    status = await MgmtdStub(rpc, mgmtd_address).status()
    return max(n.get("epoch", 0) for n in status["nodes"] if n["kind"] == "meta")


async def failover(
    rpc: Any, cache: RoutingCache, mgmtd_address: str, data_dir: Path, which: str
) -> dict[str, Any]:
    """kill -9 of the *which* primary ("meta" or "mgmtd") while one client
    creates files one after the other (retried through `MetaClient`, as the
    mount does): the longest create, and when creates flowed again."""
    meta = MetaClient(rpc, cache)
    session = (await meta.call_at_most_once("s", lambda m: m.session_open("k", "h", 1)))["session"]
    d = await meta.call_at_most_once(
        "mkdir", lambda m: m.mkdir(ROOT_INODE, b"kill-%s" % which.encode(), 0o755, 0, 0)
    )
    epoch = await meta_epoch(rpc, mgmtd_address)
    pid = await primary_pid(rpc, data_dir, mgmtd_address, which)
    done: list[tuple[float, float]] = []  # (start, end) of each create, perf_counter
    killed = -1.0

    async def creates() -> None:
        for n in itertools.count():
            t0 = time.perf_counter()
            await meta.call_at_most_once(
                "create", functools.partial(create, d["ino"], b"f%d" % n, session)
            )
            done.append((t0, time.perf_counter()))
            if 0 < killed < t0 - KILL_WINDOW:
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(creates)
        await trio.sleep(1.0)
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
    after = [(t0, t1) for t0, t1 in done if t1 > killed]
    start, end = max(after, key=lambda op: op[1] - op[0])
    return {
        f"{which}_kill_longest_create_s": round(end - start, 2),
        f"{which}_kill_to_flowing_s": round(end - killed, 2),
        f"{which}_kill_meta_epoch": f"{epoch}->{await meta_epoch(rpc, mgmtd_address)}",
    }


async def lookup(parent: int, name: bytes, m: MetaStub) -> Attr:
    return await m.lookup(parent, name)


async def getattr_(ino: int, m: MetaStub) -> Attr:
    return await m.getattr(ino)


async def create(parent: int, name: bytes, session: int, m: MetaStub) -> Any:
    return await m.create(parent, name, 0o644, FLAGS, 0, 0, session)


READ_FILES = 200
READ_TASKS = 16  # concurrent reads per reader process


async def reader(data_dir: Path, seconds: float, files: int) -> int:
    """One reader process: lookups and getattrs for *seconds*; how many."""
    config, secret = load_client_config(data_dir / "client.toml")
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        cache = RoutingCache(rpc, config.mgmtd, poll_interval=1.0)
        await cache.start(nursery)
        meta = MetaClient(rpc, cache)
        d = await meta.call_read("lookup", lambda m: m.lookup(ROOT_INODE, b"reads"))
        done = 0
        deadline = trio.current_time() + seconds

        async def task(k: int) -> None:
            nonlocal done
            i = k
            while trio.current_time() < deadline:
                name = b"r%05d" % (i % files)
                attr = await meta.call_read("lookup", functools.partial(lookup, d["ino"], name))
                await meta.call_read("getattr", functools.partial(getattr_, attr["ino"]))
                done += 2
                i += READ_TASKS

        async with trio.open_nursery() as inner:
            for k in range(READ_TASKS):
                inner.start_soon(task, k)
        nursery.cancel_scope.cancel()
    return done


async def make_read_files(data_dir: Path, files: int) -> None:
    config, secret = load_client_config(data_dir / "client.toml")
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        cache = RoutingCache(rpc, config.mgmtd)
        await cache.start(nursery)
        meta = MetaClient(rpc, cache)
        session = await meta.call_at_most_once("s", lambda m: m.session_open("r", "h", 1))
        d = await meta.call_at_most_once(
            "mkdir", lambda m: m.mkdir(ROOT_INODE, b"reads", 0o755, 0, 0)
        )
        for i in range(files):
            await meta.call_at_most_once(
                "create", functools.partial(create, d["ino"], b"r%05d" % i, session["session"])
            )
        nursery.cancel_scope.cancel()


def measure_reads(data_dir: Path, procs: int, seconds: float) -> dict[str, Any]:
    trio.run(make_read_files, data_dir, READ_FILES)
    readers = [
        subprocess.Popen(
            [sys.executable, __file__, "--reader", str(data_dir), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    total = sum(int(r.communicate(timeout=seconds + 60)[0]) for r in readers)
    return {"read_procs": procs, "reads_per_s": round(total / seconds)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--reader":
        print(trio.run(reader, Path(sys.argv[2]), float(sys.argv[3]), READ_FILES))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-servers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--read-procs", type=int, default=4, help="0: no read phase")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument(
        "--ha",
        action="store_true",
        help="format with `up --ha` (3 etcd members, 3 mgmtd) and measure the failover of "
        "the mgmtd primary too, before the metadata primary's (default: one mgmtd)",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="meta-group-", dir=args.dir or "/var/tmp"))
    try:
        for n in args.meta_servers:
            data_dir = base / f"g{n}"
            with open(os.devnull, "w") as quiet:
                lifecycle.up(data_dir, None, storage_nodes=1, meta_servers=n, out=quiet, ha=args.ha)
            try:
                if args.read_procs:
                    row = measure_reads(data_dir, args.read_procs, args.seconds)
                    print(json.dumps({"meta_servers": n, **row}))
                for i, c in enumerate(args.clients):
                    last = i == len(args.clients) - 1 and n > 1
                    kills = (("mgmtd",) if args.ha else ()) + ("meta",) if last else ()
                    row = trio.run(measure, data_dir, c, args.seconds, kills)
                    print(json.dumps({"meta_servers": n, **row}))
            finally:
                with open(os.devnull, "w") as quiet:
                    lifecycle.down(data_dir, out=quiet)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)


if __name__ == "__main__":
    main()
