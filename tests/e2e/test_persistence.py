"""Persistence: everything acknowledged survives a clean stop and a kill -9 of
every process (mount included), and the same cluster comes back with `up`."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clusters import ProcessCluster

from shufflefs.cluster import procs
from shufflefs.cluster.launcher import LocalCluster
from shufflefs.cluster.preflight import mounted_fstype


def populate(root: Path) -> dict[str, str]:
    """A small tree: files of several sizes (some spanning chunks), dirs, links."""
    (root / "a" / "b").mkdir(parents=True)
    expect: dict[str, str] = {}
    for i, size in enumerate([0, 1, 4095, 4096, 1 << 20, (3 << 20) + 17]):
        data = os.urandom(size)
        p = root / "a" / f"f{i}"
        p.write_bytes(data)
        expect[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    (root / "a" / "b" / "nested").write_text("nested")
    expect["a/b/nested"] = hashlib.sha256(b"nested").hexdigest()
    os.symlink("b/nested", root / "a" / "link")
    os.setxattr(root / "a" / "f1", "user.tag", b"kept")
    os.chmod(root / "a" / "f2", 0o600)
    return expect


def verify(root: Path, expect: dict[str, str]) -> None:
    for rel, digest in expect.items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, rel
    assert os.readlink(root / "a" / "link") == "b/nested"
    assert os.getxattr(root / "a" / "f1", "user.tag") == b"kept"
    assert (root / "a" / "f2").stat().st_mode & 0o777 == 0o600


def all_pids(cluster: LocalCluster, mountpoint: Path) -> list[int]:
    services = [*cluster.services(), cluster.mount_process(mountpoint)]
    return [pid for s in services if (pid := procs.running_pid(s)) is not None]


def kill_everything(cluster: LocalCluster, mountpoint: Path) -> None:
    pids = all_pids(cluster, mountpoint)
    assert len(pids) == len(cluster.services()) + 1
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        assert procs.wait_exit(pid, 10)


def test_clean_restart_and_kill9_restart(tmp_path: Path) -> None:
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    cluster = ProcessCluster(data, mnt)
    cluster.up()
    try:
        expect = populate(mnt)
        verify(mnt, expect)
        cluster.down(check=True)
        assert mounted_fstype(mnt) is None
        assert all_pids(cluster.local, mnt) == []

        cluster.up()
        verify(mnt, expect)
        status = cluster.status()
        assert (
            sum(1 for n in status["nodes"] if n["kind"] == "storage" and n["state"] == "online")
            == 3
        )

        kill_everything(cluster.local, mnt)
        # the mount is dead now; `up` must clear it and bring everything back
        cluster.up()
        verify(mnt, expect)
    finally:
        cluster.down()


WRITER = r"""
import hashlib, os, sys
root, log = sys.argv[1], sys.argv[2]
i = 0
with open(log, "a") as out:
    while True:
        data = os.urandom(((i * 7919) % 2_500_000) + 1)
        path = os.path.join(root, f"w{i}")
        with open(path, "wb") as f:
            f.write(data)
        # acknowledged: close() returned; record it durably before the next one
        out.write(f"{path} {hashlib.sha256(data).hexdigest()}\n")
        out.flush()
        os.fsync(out.fileno())
        i += 1
"""


def test_kill9_during_writes_keeps_every_acknowledged_file(tmp_path: Path) -> None:
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    cluster = ProcessCluster(data, mnt)
    cluster.up()
    log = tmp_path / "acked.log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt), str(log)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= 15:
                break
            assert writer.poll() is None, "writer died early"
            time.sleep(0.1)
        kill_everything(cluster.local, mnt)
        writer.kill()
        writer.wait()
        acked = [line.split() for line in log.read_text().splitlines()]
        assert len(acked) >= 15
        cluster.up()
        for path, digest in acked:
            got = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            assert got == digest, f"{path} changed after kill -9"
    finally:
        if writer.poll() is None:
            writer.kill()
        cluster.down()
