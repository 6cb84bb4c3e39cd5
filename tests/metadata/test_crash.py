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
from shufflefs.metadata.store import NamespaceStore

WORKER = Path(__file__).with_name("crash_worker.py")
ROUNDS = 6

pytestmark = pytest.mark.e2e  # starts and kills real processes


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
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        acknowledged = [int(line) for line in out.split() if line.isdigit()]
        with NamespaceStore(path, map_size=256 << 20) as ns:
            assert ns.fsck() == []
            progress = int(ns.getxattr(ROOT_INODE, b"user.progress"))
            assert acknowledged, "the worker committed nothing before it was killed"
            assert progress >= acknowledged[-1]  # nothing committed was lost
            assert progress > last
            last = progress
            counts = ns.counts()
        assert counts["inodes"] > 1 and counts["dentries"] > 0
