"""`shufflefs bench files --json` against a real mounted cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from clusters import ProcessCluster, wait_until
from procfs import open_files

from shufflefs.cluster.netns import NETNS_DIR, namespaces_available


@pytest.mark.usefixtures("kernel_caches")  # its cold rows drop them
def test_bench_files_quick_json(mounted: ProcessCluster, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", "bench", "files", "--quick",
         "--config", str(mounted.client_config), "--local-dir", str(local),
         "--files", "24", "--dirs", "3", "--size", "3000", "--procs", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["rows"]
    paths = {r["path"] for r in rows}
    assert {"local", "fuse", "native", "fuse-ro", "fuse-immutable", "fuse-prefetch"} <= paths
    assert not any("fuse-prefetch" in n for n in report["notes"])
    assert any(n.startswith("cold: ") and "open chunk files" in n for n in report["notes"])
    for r in rows:
        assert set(r) >= {"path", "procs", "cache", "op", "per_s", "ratio_to_local"}
        assert r["per_s"] > 0 and r["procs"] in (1, 2) and r["cache"] in ("cold", "warm")
    created: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["op"] == "create":
            created[r["path"]] += r["count"]
        else:
            assert r["count"] == 24, r  # every file once (scan: every entry)
        if r["path"] == "local":
            assert r["ratio_to_local"] == 1.0
    assert dict(created) == {"local": 24, "fuse": 24, "fuse-writeback": 24, "native": 24}
    reads = {(r["path"], r["procs"], r["cache"]) for r in rows if r["op"] == "read"}
    assert reads == {
        (p, n, c) for p in ("local", "fuse", "fuse-ro", "fuse-immutable", "fuse-prefetch", "native")
        for n in (1, 2)
        for c in ("cold", "warm")
    }  # fmt: skip
    loader = {(r["path"], r["cache"]) for r in report["loader"]}
    assert loader == {
        (p, c) for p in ("local", "fuse", "fuse-ro", "fuse-immutable") for c in ("cold", "warm")
    }
    # the bench removes its files from the mount and the local directory
    assert not any(p.name.startswith("bench-files-") for p in mounted.mountpoint.iterdir())
    assert list(local.iterdir()) == []


def test_bench_files_stopped_by_sigterm_leaves_nothing(
    mounted: ProcessCluster, tmp_path: Path
) -> None:
    """A benchmark stopped by SIGTERM (a job runner's stop) unmounts what it
    mounted and removes its files, as one stopped by Ctrl-C does."""
    local = tmp_path / "local"
    local.mkdir()
    scratch = tmp_path / "tmp"  # its temporary directory, apart from other tests' benches
    scratch.mkdir()
    bench = subprocess.Popen(
        [sys.executable, "-m", "shufflefs.cluster.cli", "bench", "files",
         "--config", str(mounted.client_config), "--local-dir", str(local),
         "--files", "5000", "--dirs", "5", "--size", "3000", "--procs", "2", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    try:

        def writing() -> bool:  # its set: after its ro, immutable and writeback mounts are up
            assert bench.poll() is None, bench.communicate()[1]
            return any(p.name.startswith("bench-files-") for p in mounted.mountpoint.iterdir())

        wait_until("the bench writing its set", writing, timeout=120)
        ours = bench_mounts(scratch)
        assert len(ours) == 3  # -o ro, cache=immutable, writeback
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
        assert bench.returncode == 128 + signal.SIGTERM, err
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench_mounts(scratch) == []
    assert all(not Path(m).exists() for m in ours)  # its temporary directory too
    assert not any(p.name.startswith("bench-files-") for p in mounted.mountpoint.iterdir())
    assert list(local.iterdir()) == []


def bench_mounts(scratch: Path) -> list[str]:
    """Mount points of `shufflefs bench files` (in its temporary directory,
    under *scratch*)."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p.startswith(f"{scratch}/shufflefs-files-")]


@pytest.mark.usefixtures("kernel_caches")  # its cold rows drop them
def stopped_cluster(directory: Path) -> Path:
    """A client config whose mgmtd is not there (port 9 on loopback: nothing
    listens)."""
    (directory / "secret").write_text("0" * 64)
    config = directory / "stopped-client.toml"
    config.write_text('mgmtd = "127.0.0.1:9"\nsecret_file = "secret"\n')
    return config


def test_bench_files_remote_reads_from_a_reader_host(tmp_path: Path) -> None:
    """--remote: a cluster of its own with the storage daemons on hosts of
    their own; every mount and worker runs on a reader host, no mount has a
    chunk file open while it reads (no short circuit), every row is there,
    and nothing is left behind. $SHUFFLEFS_CONFIG naming a cluster that is
    down (a user's, stopped) changes nothing: --remote starts its own."""
    why_not = namespaces_available()
    if why_not is not None:
        pytest.fail(f"--remote needs network namespaces: {why_not}")
    scratch = tmp_path / "tmp"  # its temporary directory, apart from other tests' benches
    scratch.mkdir()
    with (scratch / "out.json").open("w") as out, (scratch / "err.txt").open("w") as err:
        bench = subprocess.Popen(
            [sys.executable, "-m", "shufflefs.cluster.cli", "bench", "files", "--remote",
             "--local-dir", str(tmp_path), "--files", "60", "--dirs", "3", "--size", "40000",
             "--procs", "2", "--no-loader", "--json"],
            stdout=out, stderr=err, env={**os.environ, "TMPDIR": str(scratch),
                                         "SHUFFLEFS_CONFIG": str(stopped_cluster(scratch))},
        )  # fmt: skip
    ours = os.stat("/proc/self/ns/net").st_ino
    seen: dict[int, tuple[int, list[str]]] = {}  # pid -> (its netns, chunk files it held)
    deadline = time.monotonic() + 600
    try:
        while True:  # look at its processes until it ends (every 0.1 s)
            for pid in bench_processes(scratch, bench.pid):
                try:
                    netns = os.stat(f"/proc/{pid}/ns/net").st_ino
                    held = [f for f in open_files(pid) if "/remote/cluster/storage" in f]
                except OSError:  # (gone meanwhile)
                    continue
                # (the last host seen: a worker moves there first thing)
                seen[pid] = (netns, seen.get(pid, (netns, []))[1] + held)
            try:
                bench.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "bench files --remote still running after 600 s"
    finally:
        if bench.poll() is None:  # (its SIGTERM removes what it started)
            bench.send_signal(signal.SIGTERM)
            try:
                bench.wait(timeout=120)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
    assert bench.returncode == 0, (scratch / "err.txt").read_text()
    report = json.loads((scratch / "out.json").read_text())
    assert report["settings"]["remote"]["storage_hosts"] == 3
    assert report["settings"]["remote"]["replicas"] == 3
    assert any("no short circuit" in n for n in report["notes"])
    reads = {(r["path"], r["procs"], r["cache"]) for r in report["rows"] if r["op"] == "read"}
    assert reads == {
        (p, n, c) for p in ("local", "fuse", "fuse-ro", "fuse-immutable", "fuse-prefetch", "native")
        for n in (1, 2)
        for c in ("cold", "warm")
    }  # fmt: skip
    assert all(r["count"] == 60 for r in report["rows"] if r["op"] != "create")
    # its mounts and workers were seen, none on this host, none holding a chunk file
    assert len(seen) >= 4 + 2, seen  # the default, ro, immutable and writeback mounts; workers
    assert all(netns != ours for netns, _ in seen.values()), seen
    assert all(held == [] for _, held in seen.values()), seen
    assert bench_mounts(scratch) == []
    assert not [n for n in os.listdir(NETNS_DIR) if n.startswith(f"sfs{bench.pid}")]
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # its local set removed


def bench_processes(scratch: Path, bench: int) -> list[int]:
    """The mounts a bench under *scratch* started and its worker processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        mount = b" mount " in cmdline and str(scratch).encode() in cmdline
        worker = parent == bench and b"spawn_main" in cmdline
        if mount or worker:
            found.append(int(entry))
    return found
