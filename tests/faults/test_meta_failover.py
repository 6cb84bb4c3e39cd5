"""Metadata servers, plural: three of them (`up --meta-servers 3`), reads
spread over all three with read-your-writes, the
primary killed with kill -9 during a namespace storm from two mounts and an
fsx-like exerciser (tests/exerciser.py) on one of them, a
follower down for 10,000 mutations from 128 concurrent clients (caught up
from the log, which group commit keeps to a few hundred entries) and then
down past log trimming (caught up from a snapshot), a fourth added by
`shufflefs meta add`.

After each: every acknowledged operation is there, none was applied twice
(the storm would have seen EEXIST/ENOENT), the mounts saw no error, and
once everything is stopped every metadata server's namespace is
fsck-clean and identical to the others'.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import exerciser
import hosts as test_hosts
import pytest
import trio
from clusters import HEARTBEAT_FAST, ProcessCluster, wait_until
from harness import shufflefs

from shufflefs.client.meta_client import MetaClient
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.records import ALL_DBS, DB_INFO
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import open_rpc_client

STORM = str(Path(__file__).parent / "meta_storm.py")
STORM_MAX = 90.0  # seconds at most: the tests stop the load once it ran on after the fault
METAS = ("meta", "meta2", "meta3")
TRIMMED = re.compile(r"log trimmed through (\d+)")
LOG_KEEP = 1000  # the catch-up test's: a follower that missed more copies a snapshot


def metas(c: ProcessCluster, names: tuple[str, ...] = METAS) -> dict[str, dict[str, Any]]:
    """Each metadata server's node entry in `status --json`, by service name."""
    by_pid = {n["pid"]: n for n in c.status()["nodes"] if n["kind"] == "meta"}
    return {name: by_pid[pid] for name in names if (pid := c.pid(name)) in by_pid}


def primary(c: ProcessCluster) -> str:
    """The running metadata server the routing map names primary (right
    after a kill the map still names the dead one until its lease lapses)."""
    found: list[str] = []

    def named(status: dict[str, Any]) -> bool:
        running = {pid: name for name in METAS if (pid := c.pid(name)) is not None}
        found[:] = [
            running[n["pid"]]
            for n in status["nodes"]
            if n["kind"] == "meta"
            and n.get("role") == "primary"
            and n["state"] == "online"
            and n["pid"] in running
        ]
        return bool(found)

    c.wait_for("a metadata primary", named)
    return found[0]


def converged(c: ProcessCluster, names: tuple[str, ...] = METAS) -> None:
    """Wait until these servers have applied the same log position."""

    def same(_: Any) -> bool:
        found = metas(c, names)
        seqs = {n["applied_seq"] for n in found.values()}
        return len(seqs) == 1 and len(found) == len(names)

    c.wait_for("the metadata servers to converge", same, timeout=60)


def grace_over(c: ProcessCluster, name: str) -> None:
    """Wait until the promoted *name* has heard from every session (its
    restart grace, in which it frees no unlinked inode, is over)."""
    wait_until(f"{name}'s restart grace over", lambda: "restart grace over" in c.log(name))


def start_storm(directory: Path, seconds: float, report: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, STORM, str(directory), str(seconds), str(report)])


def stop_storms(storms: list[subprocess.Popen[bytes]]) -> None:
    for p in storms:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR2)


def progress(report: Path) -> int:
    try:
        return int(Path(f"{report}.progress").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def namespace_records(path: Path) -> dict[bytes, list[tuple[bytes, bytes]]]:
    with NamespaceStore(path, sync=False) as ns:
        assert ns.fsck() == [], path
        return ns.txns.read(
            lambda tx: {db: list(tx.prefix_items(db, b"")) for db in ALL_DBS if db != DB_INFO}
        )


def assert_identical_namespaces(c: ProcessCluster, names: tuple[str, ...] = METAS) -> None:
    """Everything stopped: each server fsck-clean, all alike."""
    records = [namespace_records(c.data_dir / d / "db" / "namespace") for d in names]
    assert records[0][b"inodes"], "the namespace is empty"
    for other in records[1:]:
        assert other == records[0]


@pytest.fixture
def three(tmp_path: Path) -> Iterator[ProcessCluster]:
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=1,
        meta_servers=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    with c.running(serving=False):
        yield c


def served_by(c: ProcessCluster, method: str) -> dict[str, int]:
    """How many *method* calls each metadata server answered so far."""
    addresses = {name: n["address"] for name, n in metas(c).items()}

    async def fetch() -> dict[str, int]:
        async with c.rpc() as rpc:
            out = {}
            for name, address in addresses.items():
                calls = await rpc.call(address, "rpc_calls", {}, timeout=5.0)
                out[name] = calls.get(method, 0)
            return out

    return trio.run(fetch)


def read_your_writes_on_followers(c: ProcessCluster, where: Path) -> None:
    """Listings right after each create see it, though most of them are
    answered by followers (metadata/follower_reads.py). (Through a mount
    without a cache watch: with one, a listing's first page is read by
    `watch_dir`, on the primary, and so here every page.)"""
    where.mkdir()
    shufflefs("mount", "--config", str(c.client_config), "-o", "no_cache_watch", str(where))
    try:
        d = where / "ryw"
        d.mkdir()
        before = served_by(c, "readdir")
        names: set[str] = set()
        for i in range(60):
            (d / f"n{i}").write_bytes(b"x")
            names.add(f"n{i}")
            assert set(os.listdir(d)) == names
        after = served_by(c, "readdir")
    finally:
        shufflefs("umount", str(where))
    lead = primary(c)
    by_followers = sum(after[n] - before.get(n, 0) for n in after if n != lead)
    # the listings spread over all three (drawn at random: 40 of 60 expected)
    assert by_followers >= 20, (before, after)


def test_primary_kill_during_a_storm_from_two_mounts(three: ProcessCluster, tmp_path: Path) -> None:
    c = three
    read_your_writes_on_followers(c, tmp_path / "unwatched")
    second = tmp_path / "mnt2"
    second.mkdir()
    shufflefs("mount", "--config", str(c.client_config), str(second))
    try:
        reports = [tmp_path / "a.json", tmp_path / "b.json"]
        dirs = [c.mountpoint / "a", second / "b"]
        storms = [start_storm(d, STORM_MAX, r) for d, r in zip(dirs, reports, strict=True)]
        # and the fsx-like exerciser (writes, truncates, mmap, reopens: the
        # metadata calls of a file's life) on the first mount
        (c.mountpoint / "fsx").mkdir()
        fsx_report = tmp_path / "fsx.json"
        fsx = exerciser.start(c.mountpoint / "fsx" / "f", 7, 50_000, STORM_MAX, fsx_report)
        deadline = time.monotonic() + 60
        while min(progress(r) for r in reports) < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        victim = primary(c)
        fsx_at_kill = exerciser.ops_so_far(fsx_report)
        c.kill(victim)
        killed_at = time.monotonic()
        new = primary(c)
        assert new != victim
        at_new = [progress(r) for r in reports], exerciser.ops_so_far(fsx_report)
        wait_until(  # everything runs on through the new primary for a while
            "the storms and the exerciser going on after the failover",
            lambda: (
                any(p.poll() is not None for p in [*storms, fsx])  # ended early: an error
                or (
                    all(progress(r) >= n + 50 for r, n in zip(reports, at_new[0], strict=True))
                    and exerciser.ops_so_far(fsx_report) >= at_new[1] + 50
                )
            ),
            timeout=90,
        )
        stop_storms(storms)
        exerciser.finish([fsx])
        for s in storms:
            assert s.wait(timeout=120) == 0
        assert fsx.wait(timeout=120) == 0, exerciser.result(fsx_report)
        fsx_result = exerciser.result(fsx_report)
        assert fsx_result["errors"] == [] and fsx_result["wrong"] == 0, fsx_result
        assert fsx_result["ops"] > fsx_at_kill + 50, "the exerciser did not run on after the kill"
        print(f"exerciser through the metadata failover: {fsx_result}")
        results = [json.loads(r.read_text()) for r in reports]
        stall = max(r["stall"] for r in results)
        print(
            f"metadata failover: longest operation {stall:.2f}s; "
            f"new primary {new} seen {time.monotonic() - killed_at:.1f}s after the kill"
        )
        for d, r in zip(dirs, results, strict=True):
            assert r["errors"] == []
            assert r["ops"] > 100
            model = r["model"]
            assert sorted(p.name for p in d.iterdir()) == sorted(model)
            for name, i in model.items():
                assert (d / name).read_bytes() == (b"%08d" % i) * (64 + i % 200)
        grace_over(c, new)
        c.start(victim)  # it comes back as a follower and catches up
        assert metas(c)[victim]["role"] == "follower"
        converged(c)
    finally:
        shufflefs("umount", str(second))
    c.down()
    assert_identical_namespaces(c)


def namespace_ops(directory: Path, count: int, tag: str) -> None:
    """*count* mutations through the mount (creates, and unlinks of half)."""
    directory.mkdir(exist_ok=True)
    for i in range(count // 2):
        (directory / f"{tag}{i}").write_bytes(b"x")
    for i in range(0, count // 2, 2):
        (directory / f"{tag}{i}").unlink()


LOAD_TASKS = 128  # concurrent clients: their mutations share group commits
LOAD_CYCLES = 18  # of 4.5 mutations: 128 x (1 + 18 x 4 + 9) + 1 = 10,497 in all
REG = stat.S_IFREG | 0o644


async def mutate(meta: MetaClient, method: str, *args: Any, **kwargs: Any) -> Any:
    """One mutation through *meta*, at most once (retried with its request id)."""
    return await meta.call_at_most_once(method, lambda m: getattr(m, method)(*args, **kwargs))


async def load_task(meta: MetaClient, parent: int, cycles: int) -> int:
    """One client's mutations in *parent*: per cycle a create (mknod), a
    setattr, a rename, a mkdir and, every other cycle, an unlink. Returns
    how many it made (the directory then holds r<odd> and d<every>)."""
    for i in range(cycles):
        f, r = b"f%d" % i, b"r%d" % i
        made = await mutate(meta, "mknod", parent, f, REG, 0, 0, 0)
        await mutate(meta, "setattr", made["ino"], mode=0o600)
        await mutate(meta, "rename", parent, f, parent, r)
        await mutate(meta, "mkdir", parent, b"d%d" % i, 0o755, 0, 0)
        if i % 2 == 0:
            await mutate(meta, "unlink", parent, r)
    return 4 * cycles + (cycles + 1) // 2


def load_expected(cycles: int) -> list[bytes]:
    return sorted([b"d%d" % i for i in range(cycles)] + [b"r%d" % i for i in range(1, cycles, 2)])


async def _meta_load(c: ProcessCluster, top: bytes, tasks: int, cycles: int) -> int:
    config, secret = load_client_config(c.client_config)
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        cache = RoutingCache(rpc, config.mgmtd, poll_interval=0.5)
        await cache.start(nursery)
        meta = MetaClient(rpc, cache)
        root = await mutate(meta, "mkdir", ROOT_INODE, top, 0o755, 0, 0)
        made = [1]

        async def one(t: int) -> None:
            d = await mutate(meta, "mkdir", root["ino"], b"t%d" % t, 0o755, 0, 0)
            made.append(1 + await load_task(meta, d["ino"], cycles))

        async with trio.open_nursery() as inner:
            for t in range(tasks):
                inner.start_soon(one, t)
        nursery.cancel_scope.cancel()
    return sum(made)


def meta_load(c: ProcessCluster, top: str, tasks: int, cycles: int) -> int:
    """Mutations through the metadata rpc from *tasks* concurrent clients
    (one task each: MetaClient, as the mount calls), in /*top*/t<task>;
    returns how many."""
    return trio.run(_meta_load, c, top.encode(), tasks, cycles)


def listing(c: ProcessCluster, name: str, top: str) -> dict[bytes, list[bytes]]:
    """Every directory of /*top* and the names in it, read from metadata
    server *name* itself (a follower answers from its own copy)."""
    address = metas(c, (name,))[name]["address"]

    async def read() -> dict[bytes, list[bytes]]:
        async with c.rpc() as rpc:
            meta = MetaStub(rpc, address)
            root = await meta.lookup(ROOT_INODE, top.encode())
            out: dict[bytes, list[bytes]] = {}
            for sub, attr in (await meta.readdir(root["ino"], limit=1024))["entries"]:
                ino = attr["ino"]
                names: list[bytes] = []
                after: bytes | None = None
                while page := (await meta.readdir(ino, after, limit=1024))["entries"]:
                    names += [n for n, _ in page]
                    after = names[-1]
                out[sub] = names
            return out

    return trio.run(read)


CAUGHT_UP = re.compile(r"follower \S+ at \d+ is (\d+) entries behind: catching up from the log")


def test_a_follower_catches_up_from_the_log_then_from_a_snapshot(tmp_path: Path) -> None:
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=1,
        meta_servers=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    for d in METAS:  # a follower that misses more entries is sent a snapshot
        with (c.data_dir / d / "meta.toml").open("a") as f:
            f.write(f"log_keep = {LOG_KEEP}\n")
    try:
        c.up()
        lead = primary(c)
        follower = next(name for name in METAS if name != lead)
        work = c.mountpoint / "w"
        namespace_ops(work, 20, "a")
        # down for 10,000 mutations: group commit packs them into far fewer
        # log entries than log_keep, so the log still has every one
        c.kill(follower)
        t0 = time.monotonic()
        made = meta_load(c, "load", LOAD_TASKS, LOAD_CYCLES)
        took = time.monotonic() - t0
        assert made >= 10_000
        lead_log = len(c.log(lead))
        c.start(follower)
        converged(c)
        since = c.log(lead)[lead_log:]
        behind = [int(n) for n in CAUGHT_UP.findall(since)]
        # the log path, every entry it missed (group commit packs 10,000
        # mutations into a few hundred entries, far fewer than log_keep)
        assert behind and behind[0] < LOG_KEEP, since
        assert "snapshot" not in since
        print(
            f"catch-up from the log: {made} mutations from {LOAD_TASKS} clients in "
            f"{took:.1f}s ({made / took:.0f}/s), {behind[0]} log entries"
        )
        expected = {b"t%d" % t: load_expected(LOAD_CYCLES) for t in range(LOAD_TASKS)}
        assert listing(c, follower, "load") == listing(c, lead, "load") == expected
        # down past log_keep entries: the log is trimmed past it meanwhile
        gone_at = metas(c)[follower]["applied_seq"]
        c.kill(follower)

        def trimmed() -> bool:
            return any(int(n) > gone_at for n in TRIMMED.findall(c.log(lead)))

        t0 = time.monotonic()
        rounds = 0
        while not trimmed():  # two clients: about one log entry per mutation
            assert rounds < 40, "the log was not trimmed past the follower"
            meta_load(c, f"past{rounds}", 2, 12)
            rounds += 1
        print(
            f"past log_keep ({LOG_KEEP}): {rounds} x 111 mutations in {time.monotonic() - t0:.1f}s"
        )
        lead_log = len(c.log(lead))
        c.start(follower)
        converged(c)
        assert "sending a snapshot" in c.log(lead)[lead_log:]
        assert "installed a snapshot" in c.log(follower)
        namespace_ops(work, 20, "d")  # and it follows the log again
        converged(c)
        # a fourth server joins the group (`shufflefs meta add`): it is sent a
        # snapshot, then follows the log like the others
        added = json.loads(shufflefs("meta", "add", "--data-dir", str(c.data_dir), "--json").stdout)
        assert (added["name"], added["role"], added["meta_servers"]) == ("meta4", "follower", 4)
        namespace_ops(work, 20, "e")
        converged(c, (*METAS, "meta4"))
        expected_work = sorted(f"{t}{i}" for t in "ade" for i in range(1, 10, 2))
        assert sorted(p.name for p in work.iterdir()) == expected_work
    finally:
        c.down()
    assert_identical_namespaces(c, (*METAS, "meta4"))


SPLIT_BRAIN = """
import sys, trio
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.client import open_rpc_client
from shufflefs.rpc.errors import FsError

async def main():
    async with open_rpc_client(open(sys.argv[1], "rb").read().strip()) as rpc:
        try:
            await MetaStub(rpc, sys.argv[2], timeout=10).mkdir(1, b"split-brain", 0o755, 0, 0)
        except FsError as exc:
            print("refused", exc.code, exc.message)
            return
        print("ACKNOWLEDGED")

trio.run(main)
"""


def test_the_cut_off_primary_acknowledges_nothing_and_rejoins(tmp_path: Path) -> None:
    why_not = test_hosts.namespaces_available()
    if why_not is not None:  # as for the remote topology: CI runs as root with netns
        pytest.fail(f"the link-cut test needs network namespaces: {why_not}")
    hosts = test_hosts.TestHosts(3)
    hosts.create()
    c: ProcessCluster | None = None
    try:
        c = ProcessCluster(
            tmp_path / "data",
            tmp_path / "mnt",
            storage_nodes=1,
            meta_servers=3,
            meta_hosts=hosts,
            mgmtd_settings=HEARTBEAT_FAST,
        )
        c.up()
        report = tmp_path / "storm.json"
        storm = start_storm(c.mountpoint / "s", STORM_MAX, report)
        deadline = time.monotonic() + 60
        while progress(report) < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        lead = primary(c)
        index = METAS.index(lead) + 1
        hosts.cut(index)
        # a client on the isolated host itself: its primary must not acknowledge
        probe = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                hosts.netns(index),
                sys.executable,
                "-c",
                SPLIT_BRAIN,
                str(c.data_dir / "secret"),
                c.layout.meta_address(index),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.stdout.startswith("refused"), probe.stdout + probe.stderr
        at_probe = progress(report)
        wait_until(
            "the storm going on through the new primary",
            lambda: storm.poll() is not None or progress(report) >= at_probe + 50,
            timeout=90,
        )
        stop_storms([storm])
        assert storm.wait(timeout=120) == 0
        result = json.loads(report.read_text())
        assert result["errors"] == [] and result["ops"] > 100
        assert sorted(p.name for p in (c.mountpoint / "s").iterdir()) == sorted(result["model"])
        assert "primary no more" in c.log(lead)
        grace_over(c, primary(c))
        hosts.restore(index)
        c.wait_for(
            "the old primary back as a follower",
            lambda s: any(
                n["pid"] == c.pid(lead) and n["state"] == "online" and n["role"] == "follower"
                for n in s["nodes"]
            ),
        )
        converged(c)
        assert not (c.mountpoint / "split-brain").exists()
        print(f"link cut: longest operation {result['stall']:.2f}s")
    finally:
        if c is not None:
            c.down()
        hosts.destroy()
    assert_identical_namespaces(c)
