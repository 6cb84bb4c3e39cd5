"""Crash consistency: a process mutating the namespace is killed with SIGKILL
at random moments; every time, the reopened namespace passes fsck() and
still holds every mutation the process saw committed."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.records import DB_SESSIONS, read_u64
from shufflefs.metadata.store import NamespaceStore

WORKER = Path(__file__).with_name("crash_worker.py")
ROUNDS = 6

pytestmark = pytest.mark.e2e  # starts and kills real processes


def started_as_the_server_does(ns: NamespaceStore) -> None:
    """Reopened after the kill as the metadata server starts: every session
    in the grace (the handles were in the killed process's memory; an
    unlinked file one of them held waits for its client to re-report or
    expire). Consistent as it is."""
    ns.restart_leases()
    assert ns.fsck() == []


def grace_over(ns: NamespaceStore) -> None:
    """Every session gone (as their expiry would) and the grace's sweep
    done: no inode is left without a name and a handle."""
    sessions = ns.txns.read(lambda tx: [read_u64(k) for k, _ in tx.prefix_items(DB_SESSIONS, b"")])
    for session in sessions:
        ns.session_close(session)
    ns.sweep_orphans()
    assert ns.fsck() == []
    assert ns.txns.read(lambda tx: [k for k, _ in tx.prefix_items(DB_SESSIONS, b"")]) == []


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    path = tmp_path / "namespace"
    rng = random.Random(20240611)
    last = 0
    for round_ in range(ROUNDS):
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(path), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            # its first commit acknowledged before the clock starts: on a loaded
            # machine a durable commit can take longer than the shortest sleep
            first = proc.stdout.readline().strip()
            assert first.isdigit(), first
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        acknowledged = [int(line) for line in [first, *out.split()] if line.isdigit()]
        with NamespaceStore(path, map_size=256 << 20) as ns:
            started_as_the_server_does(ns)
            progress = int(ns.getxattr(ROOT_INODE, b"user.progress"))
            assert acknowledged, "the worker committed nothing before it was killed"
            assert progress >= acknowledged[-1]  # nothing committed was lost
            assert progress > last
            last = progress
            counts = ns.counts()
            grace_over(ns)
        assert counts["inodes"] > 1 and counts["dentries"] > 0


STORM = Path(__file__).with_name("storm_worker.py")
STORM_TASKS = 32


def stage_on_disk(ns: NamespaceStore, d: int, n: int, acked: int) -> int:
    """How far file n of a storm task got: 1 f<n> exists, 2 r<n> exists,
    else 3 (unlinked) if it was ever created, 0 if not."""
    names = {name for name, _ in ns.readdir(d, None, 1024)["entries"]}
    f, r = b"f%d" % n in names, b"r%d" % n in names
    assert not (f and r), f"file {n} under both names"
    return 1 if f else 2 if r else 3 if acked >= 1 else 0


def test_sigkill_during_concurrent_storm(tmp_path: Path) -> None:
    """Many concurrent mutations share group commits; a kill -9 at any
    moment leaves a consistent namespace holding every acknowledged one."""
    path = tmp_path / "namespace"
    rng = random.Random(20261201)
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, str(STORM), str(path), str(round_), str(STORM_TASKS)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.3, 1.5))
        finally:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        lines = out.splitlines()
        assert not [line for line in lines if line.startswith("bad")]
        acked: dict[tuple[int, int], int] = {}
        for line in lines:
            parts = line.split()
            if len(parts) == 3:  # a line cut by the kill has fewer
                i, n, stage = map(int, parts)
                acked[i, n] = max(acked.get((i, n), 0), stage)
        assert len(acked) > STORM_TASKS, "the storm acknowledged almost nothing"
        with NamespaceStore(path, map_size=256 << 20) as ns:
            started_as_the_server_does(ns)
            for (i, n), stage in acked.items():
                d = ns.lookup(ROOT_INODE, b"R%dt%d" % (round_, i))["ino"]
                # every acknowledged step is there; at most the one in flight beyond it
                assert stage <= stage_on_disk(ns, d, n, stage) <= stage + 1, (i, n, stage)
            grace_over(ns)
