#!/usr/bin/env python3
"""Recovery time of a dead storage node: 1 target per node against 4.

    .venv/bin/python bench/recovery.py [--hosts 6] [--link-mbps 20] [--size-mb 240] \\
        [--targets 1,4] [--out docs/recovery.md]

For each targets-per-node count it starts a cluster on K network-namespace
storage hosts (`cluster/netns_cluster.py`), each link capped with `tc` at
--link-mbps each way, replicas 3, and a mount on a reader host; writes
--size-mb of data through the mount; kills one storage daemon with SIGKILL
and times, from the kill, until mgmtd marks it offline, starts its
``replace-NODE`` job (`cluster/replace.py`; `replace_offline_after` 1 s
here) and the job is done (every chain has 3 serving members, none on the
dead node, which mgmtd then removes). It reads the surviving daemons'
``resync done`` log lines for the bytes copied and the source node of each
copy, checks the data reads back intact, and writes a table.

With one target per node the dead node's data is one chain's: a single copy,
one source link to one new member's link. With four, its four chains are
copied at once from different partners to different nodes, so the time to
full replication falls by up to the number of targets (the links, not the
data, are the limit). Keep K x cap well below what the shared CPU can push.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from shufflefs.cluster import procs
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.netns import namespaces_available
from shufflefs.cluster.netns_cluster import RemoteCluster
from shufflefs.cluster.protocol import MgmtdStub, RoutingInfo
from shufflefs.rpc import open_rpc_client

MiB = 1 << 20
SETTINGS = {
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 3.0,
    "replace_offline_after": 1.0,
    "replace_parallel": 16,
}
RESYNC_DONE = re.compile(
    r"resync done target=(\d+) chain=(\d+) source=(\d+).*?bytes_copied=(\d+).*?seconds=([0-9.]+)"
)
DEADLINE = 600.0  # seconds one recovery may take before the run is given up


def fill(path: Path, size: int) -> str:
    """Write *size* bytes of incompressible data; their sha256."""
    digest = hashlib.sha256()
    block = os.urandom(MiB)
    with path.open("wb") as f:
        for i in range(size // MiB):
            chunk = block[i % 251 :] + block[: i % 251]
            digest.update(chunk)
            f.write(chunk)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(4 * MiB):
            digest.update(block)
    return digest.hexdigest()


async def watch(rc: RemoteCluster, victim: int, kill: Any) -> dict[str, float]:
    """Kill (*kill()*), then poll mgmtd until the victim is replaced; the
    seconds from the kill to each step."""
    _, secret = load_client_config(rc.client_config)
    times: dict[str, float] = {}
    async with open_rpc_client(secret) as rpc:
        mgmtd = MgmtdStub(rpc, rc.local.layout().mgmtd_address)
        t0 = trio.current_time()
        kill()
        with trio.fail_after(DEADLINE):
            while True:
                await trio.sleep(0.1)
                now = trio.current_time() - t0
                status: RoutingInfo = await mgmtd.status()
                node = next((n for n in status["nodes"] if n["id"] == victim), None)
                if node is not None and node["state"] != "online":
                    times.setdefault("offline", now)
                jobs = await mgmtd.jobs()
                if any(j["id"] == f"replace-{victim}" for j in jobs):
                    times.setdefault("job", now)
                if node is None and all(t["state"] == "serving" for t in status["targets"]):
                    times["done"] = now
                    return times


def run_one(targets: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rc = RemoteCluster(
        workdir / f"t{targets}",
        args.hosts,
        1,
        replicas=3,
        link_rate=int(args.link_mbps * 1e6),
        mgmtd_settings=SETTINGS,
        targets_per_node=targets,
    )
    with rc:
        mnt = workdir / f"mnt{targets}"
        rc.mount(mnt)
        t0 = time.monotonic()
        digest = fill(mnt / "data.bin", args.size_mb * MiB)
        fill_s = time.monotonic() - t0
        services = {s.name: s for s in rc.local.services()}

        async def nodes() -> RoutingInfo:
            _, secret = load_client_config(rc.client_config)
            async with open_rpc_client(secret) as rpc:
                return await MgmtdStub(rpc, rc.local.layout().mgmtd_address).status()

        status = trio.run(nodes)
        pid = procs.running_pid(services["storage1"])
        assert pid is not None
        victim = next(n["id"] for n in status["nodes"] if n["pid"] == pid)
        node_of = {t["id"]: t["node"] for t in status["targets"]}
        chains = [c for c in status["chains"] if any(node_of[t] == victim for t in c["targets"])]
        names = [n for n in services if n.startswith("storage") and n != "storage1"]
        logs = {n: rc.local.logs / f"{n}.log" for n in names}
        offsets = {n: p.stat().st_size for n, p in logs.items()}
        times = trio.run(watch, rc, victim, lambda: procs.signal_pid(pid, signal.SIGKILL))
        copies = []
        for n, p in logs.items():
            with p.open("rb") as f:
                f.seek(offsets[n])
                text = f.read().decode(errors="replace")
            for _, _, source, nbytes, seconds in RESYNC_DONE.findall(text):
                copies.append((n, node_of.get(int(source)), int(nbytes) / 1e6, float(seconds)))
        copied = sum(mb for _, _, mb, _ in copies) * 1e6
        sources = {src for _, src, _, _ in copies}
        intact = sha256(mnt / "data.bin") == digest
    return {
        "targets": targets,
        "chains": len(status["chains"]),
        "victim_chains": len(chains),
        "fill_s": fill_s,
        "copied_mb": copied / 1e6,
        "sources": len(sources),
        "destinations": len({dest for dest, _, _, _ in copies}),
        "copies": copies,
        "intact": intact,
        **times,
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"{args.hosts} storage hosts (network namespaces), each link capped at "
        f"{args.link_mbps:g} MB/s each way, replicas 3, {args.size_mb} MB written, "
        "one storage daemon killed with SIGKILL; `heartbeat_timeout` 3 s, "
        "`replace_offline_after` 1 s. Times are seconds from the kill.",
        "",
        "| targets/node | chains | dead node's chains | copied MB | copy sources / "
        "destinations (nodes) | "
        "offline | job started | re-replicated | copy time (job to done) | copy MB/s | "
        "data intact |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        copy = r["done"] - r.get("job", r["offline"])
        lines.append(
            f"| {r['targets']} | {r['chains']} | {r['victim_chains']} | {r['copied_mb']:.0f} | "
            f"{r['sources']} / {r['destinations']} | {r['offline']:.1f} | "
            f"{r.get('job', float('nan')):.1f} | "
            f"{r['done']:.1f} | {copy:.1f} | {r['copied_mb'] / copy:.1f} | "
            f"{'yes' if r['intact'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=6, help="storage hosts")
    p.add_argument("--link-mbps", type=float, default=20.0, help="cap per storage host link, MB/s")
    p.add_argument("--size-mb", type=int, default=240, help="data written before the kill")
    p.add_argument("--targets", type=int_list, default=[1, 4], help="targets per node to compare")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args()
    why = namespaces_available()
    if why:
        sys.exit(f"bench/recovery.py needs network namespaces: {why}")
    command = "python bench/recovery.py " + " ".join(sys.argv[1:])
    results = []
    with tempfile.TemporaryDirectory(prefix="shufflefs-recovery-") as tmp:
        for targets in args.targets:
            print(f"{targets} target(s) per node ...", file=sys.stderr)
            results.append(run_one(targets, args, Path(tmp)))
            print(results[-1], file=sys.stderr)
    text = table(results, args, command.strip())
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
