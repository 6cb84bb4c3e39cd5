"""Metadata servers, plural: three of them (`up --meta-servers 3`), reads
spread over all three with read-your-writes, the
primary killed with kill -9 during a namespace storm from two mounts and an
fsx-like exerciser (tests/exerciser.py) on one of them, a
follower down while the log moves on (caught up from the log, or from a
snapshot once the log was trimmed past it), a fourth added by `shufflefs
meta add`.

After each: every acknowledged operation is there, none was applied twice
(the storm would have seen EEXIST/ENOENT), the mounts saw no error, and
once everything is stopped every metadata server's namespace is
fsck-clean and identical to the others'.
"""

from __future__ import annotations

import json
import os
import re
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

from shufflefs.metadata.records import ALL_DBS, DB_INFO
from shufflefs.metadata.store import NamespaceStore

STORM = str(Path(__file__).parent / "meta_storm.py")
METAS = ("meta", "meta2", "meta3")
TRIMMED = re.compile(r"log trimmed through (\d+)")


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


def start_storm(directory: Path, seconds: float, report: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, STORM, str(directory), str(seconds), str(report)])


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


def read_your_writes_on_followers(c: ProcessCluster) -> None:
    """Listings right after each create see it, though most of them are
    answered by followers (metadata/follower_reads.py)."""
    d = c.mountpoint / "ryw"
    d.mkdir()
    before = served_by(c, "readdir")
    names: set[str] = set()
    for i in range(60):
        (d / f"n{i}").write_bytes(b"x")
        names.add(f"n{i}")
        assert set(os.listdir(d)) == names
    after = served_by(c, "readdir")
    lead = primary(c)
    by_followers = sum(after[n] - before.get(n, 0) for n in after if n != lead)
    assert by_followers >= 30, (before, after)  # the listings spread over all three


def test_primary_kill_during_a_storm_from_two_mounts(three: ProcessCluster, tmp_path: Path) -> None:
    c = three
    read_your_writes_on_followers(c)
    second = tmp_path / "mnt2"
    second.mkdir()
    shufflefs("mount", "--config", str(c.client_config), str(second))
    try:
        reports = [tmp_path / "a.json", tmp_path / "b.json"]
        dirs = [c.mountpoint / "a", second / "b"]
        storms = [start_storm(d, 25.0, r) for d, r in zip(dirs, reports, strict=True)]
        # and the fsx-like exerciser (writes, truncates, mmap, reopens: the
        # metadata calls of a file's life) on the first mount
        (c.mountpoint / "fsx").mkdir()
        fsx_report = tmp_path / "fsx.json"
        fsx = exerciser.start(c.mountpoint / "fsx" / "f", 7, 50_000, 25.0, fsx_report)
        deadline = time.monotonic() + 60
        while min(progress(r) for r in reports) < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        victim = primary(c)
        fsx_at_kill = exerciser.ops_so_far(fsx_report)
        c.kill(victim)
        killed_at = time.monotonic()
        new = primary(c)
        assert new != victim
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


def test_a_follower_catches_up_from_the_log_then_from_a_snapshot(tmp_path: Path) -> None:
    c = ProcessCluster(
        tmp_path / "data",
        tmp_path / "mnt",
        storage_nodes=1,
        meta_servers=3,
        mgmtd_settings=HEARTBEAT_FAST,
    )
    for d in METAS:  # a short log: a follower that misses more is sent a snapshot
        with (c.data_dir / d / "meta.toml").open("a") as f:
            f.write("log_keep = 1000\n")
    try:
        c.up()
        lead = primary(c)
        follower = next(name for name in METAS if name != lead)
        work = c.mountpoint / "w"
        namespace_ops(work, 100, "a")
        c.kill(follower)
        namespace_ops(work, 200, "b")  # fewer than log_keep: the log still has them
        c.start(follower)
        converged(c)
        assert "sending a snapshot" not in c.log(lead)
        gone_at = metas(c)[follower]["applied_seq"]
        c.kill(follower)
        namespace_ops(work, 1500, "c")  # past log_keep: trimmed while it is away
        wait_until(
            "the primary's log trimmed past the follower",
            lambda: any(int(n) > gone_at for n in TRIMMED.findall(c.log(lead))),
        )
        c.start(follower)
        converged(c)
        assert "sending a snapshot" in c.log(lead)
        assert "installed a snapshot" in c.log(follower)
        namespace_ops(work, 20, "d")  # and it follows the log again
        converged(c)
        # a fourth server joins the group (`shufflefs meta add`): it is sent a
        # snapshot, then follows the log like the others
        added = json.loads(shufflefs("meta", "add", "--data-dir", str(c.data_dir), "--json").stdout)
        assert (added["name"], added["role"], added["meta_servers"]) == ("meta4", "follower", 4)
        namespace_ops(work, 20, "e")
        converged(c, (*METAS, "meta4"))
        expected = sorted(
            f"{t}{i}"
            for t, n in (("a", 100), ("b", 200), ("c", 1500), ("d", 20), ("e", 20))
            for i in range(1, n // 2, 2)
        )
        assert sorted(p.name for p in work.iterdir()) == expected
    finally:
        c.down()
    assert_identical_namespaces(c, (*METAS, "meta4"))


SPLIT_BRAIN = """
import sys, trio
from shufflefs.metadata.protocol import MetaStub
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
        storm = start_storm(c.mountpoint / "s", 25.0, report)
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
        assert storm.wait(timeout=120) == 0
        result = json.loads(report.read_text())
        assert result["errors"] == [] and result["ops"] > 100
        assert sorted(p.name for p in (c.mountpoint / "s").iterdir()) == sorted(result["model"])
        assert "primary no more" in c.log(lead)
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
