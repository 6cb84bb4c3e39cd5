"""Many targets per node: the chain table spreads each node over chains with
different partners, so a node that comes back is resynced from several
nodes at once, not from one. Draining a node moves its replicas away while
reads go on; a rebalance moves replicas onto a node added later."""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from clusters import (
    HEARTBEAT_FAST,
    ProcessCluster,
    assert_replicas_identical,
    replica_states,
    wait_until,
)
from harness import shufflefs
from loadgen import content

from shufflefs.cluster.protocol import JobInfo, MgmtdStub

MiB = 1 << 20
RESYNC_START = re.compile(r"resync start target=(\d+) chain=(\d+) chain_version=\d+ source=(\d+)")


@pytest.fixture
def four_by_three(tmp_path: Path) -> Iterator[ProcessCluster]:
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=4,
        replicas=3,
        targets_per_node=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    with c.running():
        yield c


def test_a_returning_node_is_resynced_from_several_nodes(four_by_three: ProcessCluster) -> None:
    c = four_by_three
    status = c.status()
    node_of = {t["id"]: t["node"] for t in status["targets"]}
    chains = [[node_of[t] for t in ch["targets"]] for ch in status["chains"]]
    # 12 targets, 3 per chain: 4 chains; every node in 3, every pair of nodes in 2
    assert len(chains) == 4 and all(len(set(ch)) == 3 for ch in chains)
    nodes = sorted({n for ch in chains for n in ch})
    assert len(nodes) == 4
    for a, b in itertools.combinations(nodes, 2):
        assert sum(1 for ch in chains if a in ch and b in ch) == 2, (a, b, chains)

    first = c.mountpoint / "before.bin"
    first.write_bytes(content(1, 24 * MiB))  # 24 chunks over the 4 chains
    victim = c.storage_node_of("storage1")
    log_before = len(c.log("storage1"))
    c.kill("storage1")
    c.wait_for(
        "storage1's targets offline",
        lambda s: all(t["state"] == "offline" for t in s["targets"] if t["node"] == victim),
    )
    second = c.mountpoint / "while-away.bin"
    second.write_bytes(content(2, 16 * MiB))  # what storage1 misses
    c.restart_missing()
    c.all_serving()

    starts = RESYNC_START.findall(c.log("storage1")[log_before:])
    assert starts, "storage1 did not resync"
    sources = {node_of[int(source)] for _, _, source in starts}
    mine = {int(target) for target, _, _ in starts}
    assert mine == {t for t, n in node_of.items() if n == victim}
    assert victim not in sources
    # each of its 3 chains syncs from a partner: more than one node feeds it
    assert len(sources) >= 2, f"resynced only from {sources}"
    print(f"RECOVERY: node {victim}'s {len(mine)} targets resynced from nodes {sorted(sources)}")
    for path, seed, size in ((first, 1, 24 * MiB), (second, 2, 16 * MiB)):
        digest = hashlib.sha256(content(seed, size)).hexdigest()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


@pytest.fixture
def four_nodes(tmp_path: Path) -> Iterator[ProcessCluster]:
    """4 storage nodes of one target, 3 replicas: one chain and a spare."""
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=4,
        replicas=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    with c.running():
        yield c


def read_loop(path: Path, expected: bytes, stop: threading.Event, report: dict[str, int]) -> None:
    """Random 64 KiB O_DIRECT reads through the mount (so each one reaches the
    storage daemons, not the page cache) until *stop*; at most 120 s."""
    rng = random.Random(5)
    buf = mmap.mmap(-1, 65536)
    deadline = time.monotonic() + 120
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            at = rng.randrange(0, len(expected) // 65536) * 65536
            try:
                n = os.preadv(fd, [buf], at)
            except OSError:
                report["failed"] += 1
                continue
            report["reads"] += 1
            report["wrong"] += n != 65536 or buf[:] != expected[at : at + 65536]
    finally:
        os.close(fd)


def test_drain_under_reads_then_remove(four_nodes: ProcessCluster, tmp_path: Path) -> None:
    c = four_nodes
    expected = content(3, 16 * MiB)
    data = c.mountpoint / "train.bin"
    data.write_bytes(expected)
    status = c.status()
    (chain,) = status["chains"]
    node_of = {t["id"]: t["node"] for t in status["targets"]}
    victim = node_of[chain["targets"][0]]
    (spare,) = [t for t in node_of if t not in chain["targets"]]
    config = ["--config", str(c.client_config)]

    stop, report = threading.Event(), {"reads": 0, "failed": 0, "wrong": 0}
    reader = threading.Thread(target=read_loop, args=(data, expected, stop, report))
    reader.start()
    try:
        # before: removing it, or a target still in a chain, is refused
        busy = shufflefs("node", "remove", str(victim), *config, check=False)
        assert busy.returncode != 0 and "drain it first" in busy.stderr
        busy = shufflefs("target", "remove", str(chain["targets"][1]), *config, check=False)
        assert busy.returncode != 0 and "chain" in busy.stderr
        out = shufflefs(
            "node", "drain", str(victim), "--wait", "--timeout", "120", "--json", *config
        )
        assert json.loads(out.stdout)["drained"] is True
    finally:
        stop.set()
        reader.join(60)
    assert report["reads"] > 0 and report["failed"] == 0 and report["wrong"] == 0, report
    after = c.status()
    (chain,) = after["chains"]
    assert spare in chain["targets"] and all(node_of[t] != victim for t in chain["targets"])
    assert all(t["state"] == "serving" for t in after["targets"] if t["id"] in chain["targets"])
    # another drain has nowhere to go now: refused, and nothing changes
    other = node_of[chain["targets"][0]]
    refused = shufflefs("node", "drain", str(other), *config, check=False)
    assert refused.returncode != 0 and "no spare target" in refused.stderr
    assert c.status()["chains"] == after["chains"]
    daemon = next(f"storage{i}" for i in range(1, 5) if c.storage_node_of(f"storage{i}") == victim)
    shufflefs("node", "remove", str(victim), *config)
    # its daemon, still running, tries to register again: refused, it stops
    wait_until("the removed node's daemon to stop", lambda: c.pid(daemon) is None, timeout=30)
    assert "was removed from this cluster" in c.log(daemon)
    assert victim not in {n["id"] for n in c.status()["nodes"]}
    assert data.read_bytes() == expected
    print(f"DRAIN: node {victim} drained under {report['reads']} reads, none failed")


def test_rebalance_onto_two_added_nodes_under_reads(
    four_by_three: ProcessCluster, tmp_path: Path
) -> None:
    """Two nodes join a running 4x3 cluster: their targets stay spares until
    `shufflefs rebalance` moves chain memberships onto them, one at a time,
    while reads run; `jobs` lists the job and `jobs cancel` stops one; a
    restart of mgmtd does not lose one. At the end every node holds the same
    bytes within 10 %, every replica is byte-identical, no read failed."""
    c = four_by_three
    config = ["--config", str(c.client_config)]
    expected = content(4, 24 * MiB)  # 24 chunks over the 4 chains: every target holds some
    data = c.mountpoint / "train.bin"
    data.write_bytes(expected)
    nothing = shufflefs("rebalance", *config, check=False)
    assert nothing.returncode == 1 and "nothing to rebalance" in nothing.stderr

    shufflefs("up", "--data-dir", str(c.data_dir), "--storage-nodes", "6", "--no-mount")
    added = {c.storage_node_of("storage5"), c.storage_node_of("storage6")}
    c.wait_for(
        "the added nodes' 6 targets serving as spares",
        lambda s: [t["state"] for t in s["targets"] if t["node"] in added] == ["serving"] * 6,
    )
    assert len(c.status()["chains"]) == 4  # two nodes with spares make no chain of 3
    replicas = c.status()["config"]["replicas"]

    # started, listed and cancelled in one go (a move takes far longer than
    # three calls): the move in flight is rolled back
    async def start_list_cancel() -> tuple[JobInfo, list[JobInfo], JobInfo]:
        async with c.rpc() as rpc:
            mgmtd = MgmtdStub(rpc, c.mgmtd_address)
            job = await mgmtd.rebalance()
            return job, await mgmtd.jobs(), await mgmtd.cancel_job(job["id"])

    started, listed, cancelled = trio.run(start_list_cancel)
    assert started["state"] == "running" and started["left"] >= 2, started
    kinds = {j["id"]: j["kind"] for j in listed}
    assert kinds[started["id"]] == "rebalance" and "resync" in kinds.values(), listed
    newcomer = next(int(i.removeprefix("resync-")) for i, k in kinds.items() if k == "resync")
    assert cancelled["state"] == "cancelled", cancelled
    c.wait_for(
        "every chain back to its replicas, all serving",
        lambda s: (
            all(len(ch["targets"]) == replicas for ch in s["chains"])
            and all(t["state"] == "serving" for t in s["targets"])
        ),
    )
    assert all(newcomer not in ch["targets"] for ch in c.status()["chains"])
    again = shufflefs("jobs", "cancel", started["id"], *config, check=False)
    assert again.returncode == 1 and "no running job" in again.stderr

    # `rebalance --wait` under reads, with mgmtd killed and restarted once the
    # job has started: the job is in mgmtd's state, carries on, and the wait
    # keeps looking while mgmtd is away
    stop, report = threading.Event(), {"reads": 0, "failed": 0, "wrong": 0}
    reader = threading.Thread(target=read_loop, args=(data, expected, stop, report))
    reader.start()
    argv = ["rebalance", "--wait", "--timeout", "120", "--json", *config]
    waiting = subprocess.Popen(
        [sys.executable, "-m", "shufflefs.cluster.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert waiting.stderr is not None
        first = waiting.stderr.readline()  # the job has started
        assert re.match(r"rebalance-\d+: \d+/\d+ moves", first), first
        c.kill("mgmtd")
        c.restart_missing()
        stdout, stderr = waiting.communicate(timeout=150)
    finally:
        waiting.kill()
        stop.set()
        reader.join(60)
    assert waiting.returncode == 0, stderr
    out = subprocess.CompletedProcess(argv, 0, stdout, first + stderr)
    result = json.loads(out.stdout)
    assert result["id"] == first.partition(":")[0]  # the same job, carried on
    assert result["state"] == "done" and result["done"] >= 4, result
    assert "moves" in out.stderr  # not a terminal: a plain progress line per change
    assert report["reads"] > 0 and report["failed"] == 0 and report["wrong"] == 0, report

    after = c.status()
    node_of = {t["id"]: t["node"] for t in after["targets"]}
    state_of = {t["id"]: t["state"] for t in after["targets"]}
    held = {n: 0 for n in {t["node"] for t in after["targets"]}}
    for ch in after["chains"]:
        assert len(ch["targets"]) == replicas and len({node_of[t] for t in ch["targets"]}) == 3
        assert all(state_of[t] == "serving" for t in ch["targets"]), ch
        for t in ch["targets"]:
            held[node_of[t]] += 1
    assert all(held[n] >= 2 for n in added), held
    # usage evened out: the bytes of the replicas each node holds, from the
    # daemons' own chunk lists (every replica byte-identical to its chain's head)
    assert assert_replicas_identical(c) == 24
    stored = {n: 0 for n in held}
    for ch, members in zip(after["chains"], replica_states(c).values(), strict=True):
        for t, chunks in zip(ch["targets"], members, strict=True):
            stored[node_of[t]] += sum(length for _, length, _ in chunks.values())
    mean = sum(stored.values()) / len(stored)
    assert all(abs(b - mean) <= 0.1 * mean for b in stored.values()), stored
    assert hashlib.sha256(data.read_bytes()).hexdigest() == hashlib.sha256(expected).hexdigest()
    jobs = json.loads(shufflefs("jobs", "--json", *config).stdout)["jobs"]
    assert [(j["id"], j["state"]) for j in jobs] == [(result["id"], "done")], jobs
    assert result["id"] in shufflefs("jobs", *config).stdout
    print(
        f"REBALANCE: {result['done']} moves onto nodes {sorted(added)}, memberships {held}, "
        f"MiB per node {[b >> 20 for b in stored.values()]}, under {report['reads']} reads"
    )


REPLACE_AFTER = 2.0  # seconds a node stays offline before it is re-replicated


def watch_jobs(c: ProcessCluster, stop: threading.Event, seen: dict[str, JobInfo]) -> None:
    """mgmtd's job list every 0.1 s until *stop* (at most 120 s): each job id seen."""

    async def poll() -> None:
        async with c.rpc() as rpc:
            mgmtd = MgmtdStub(rpc, c.mgmtd_address)
            with trio.move_on_after(120):
                while not stop.is_set():
                    for job in await mgmtd.jobs():
                        seen.setdefault(job["id"], job)
                    await trio.sleep(0.1)

    trio.run(poll)


@pytest.fixture
def five_by_three(tmp_path: Path) -> Iterator[ProcessCluster]:
    """5 nodes x 3 targets, 3 replicas (5 chains, no spares), dead nodes re-replicated quickly."""
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=5,
        replicas=3,
        targets_per_node=3,
        mgmtd_settings={**HEARTBEAT_FAST, "replace_offline_after": REPLACE_AFTER},
    )
    with c.running():
        yield c


def test_a_node_that_stays_dead_is_re_replicated_from_its_partners(
    five_by_three: ProcessCluster,
) -> None:
    """kill -9 of one node's daemon: after `replace_offline_after` mgmtd's
    replace job gives each of its chains a new member on another node
    (created there: the table has no spares), resynced from the chain's
    survivors, while reads go on; the node is then removed, and its daemon,
    started again, is refused and stops without serving."""
    c = five_by_three
    config = ["--config", str(c.client_config)]
    expected = content(6, 30 * MiB)  # 30 chunks over the 5 chains
    data = c.mountpoint / "train.bin"
    data.write_bytes(expected)
    before = c.status()
    node_of = {t["id"]: t["node"] for t in before["targets"]}
    daemon = "storage2"
    victim = c.storage_node_of(daemon)
    dead_chains = {
        ch["id"] for ch in before["chains"] if any(node_of[t] == victim for t in ch["targets"])
    }
    assert len(dead_chains) == 3
    names = [f"storage{i}" for i in range(1, 6) if f"storage{i}" != daemon]
    logs_before = {n: len(c.log(n)) for n in names}

    stop, report = threading.Event(), {"reads": 0, "failed": 0, "wrong": 0}
    reader = threading.Thread(target=read_loop, args=(data, expected, stop, report))
    seen: dict[str, JobInfo] = {}
    watcher = threading.Thread(target=watch_jobs, args=(c, stop, seen))
    reader.start()
    watcher.start()
    try:
        c.kill(daemon)
        c.wait_for(
            f"node {victim} re-replicated and removed",
            lambda s: (
                victim not in {n["id"] for n in s["nodes"]}
                and all(t["state"] == "serving" for t in s["targets"])
            ),
            timeout=120,
        )
    finally:
        stop.set()
        reader.join(60)
        watcher.join(60)
    assert report["reads"] > 0 and report["failed"] == 0 and report["wrong"] == 0, report
    job = seen.get(f"replace-{victim}")  # listed by `shufflefs jobs` while it ran
    assert job is not None and job["kind"] == "replace", seen
    assert "offline for" in job["detail"] and job["state"] == "running", job

    after = c.status()
    node_of = {t["id"]: t["node"] for t in after["targets"]}
    live = {n["id"] for n in after["nodes"] if n["kind"] == "storage" and n["state"] == "online"}
    assert victim not in live and len(live) == 4
    for ch in after["chains"]:
        nodes = [node_of[t] for t in ch["targets"]]
        assert len(nodes) == 3 and len(set(nodes)) == 3 and set(nodes) <= live, ch
    assert assert_replicas_identical(c) >= 30
    assert hashlib.sha256(data.read_bytes()).hexdigest() == hashlib.sha256(expected).hexdigest()

    # who fed the copies: the new members' resyncs, on the surviving nodes
    new = {t for ch in after["chains"] for t in ch["targets"]} - set(
        t for ch in before["chains"] for t in ch["targets"]
    )
    assert len(new) == len(dead_chains)
    starts = [
        m
        for n in names
        for m in RESYNC_START.findall(c.log(n)[logs_before[n] :])
        if int(m[0]) in new
    ]
    assert {int(t) for t, _, _ in starts} == new
    sources = {node_of[int(source)] for _, _, source in starts}
    assert victim not in sources and len(sources) >= 2, f"re-replicated only from {sources}"
    mgmtd_log = c.log("mgmtd")
    assert f"re-replicating node {victim} (all its targets offline for" in mgmtd_log
    jobs = json.loads(shufflefs("jobs", "--json", *config).stdout)["jobs"]
    assert not [j for j in jobs if j["kind"] in ("replace", "resync")], jobs

    # the dead daemon comes back: refused (it was removed), it stops, serves nothing
    c.start(daemon, wait=False)
    wait_until("the replaced node's daemon to stop", lambda: c.pid(daemon) is None, timeout=30)
    assert "was removed from this cluster" in c.log(daemon)
    assert c.status()["chains"] == after["chains"]
    print(
        f"REPLACE: node {victim}'s {len(dead_chains)} chains re-replicated from nodes "
        f"{sorted(sources)} onto new targets {sorted(new)} under {report['reads']} reads"
    )
