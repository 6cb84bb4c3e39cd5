"""The real topology (`shufflefs.cluster.netns_cluster`): storage daemons on
their own network-namespace hosts, the reader (mount, native client) on
another one. Reads there must cross the network: no reader process has a
chunk file open; a storage host killed or cut off during a read loop costs
no failed read and no wrong byte; `shufflefs bench --remote` leaves no
namespace, process or file behind, also when interrupted."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import loadgen
import pytest
from clusters import HEARTBEAT_FAST, ProcessCluster, wait_until
from harness import interruptible
from loadgen import content
from opsworld import total
from procfs import open_files

from shufflefs.cluster.netns import NETNS_DIR, enter_command, ip, namespaces_available
from shufflefs.cluster.netns_cluster import RemoteCluster

MiB = 1 << 20
LOADGEN = str(Path(__file__).parent.parent / "loadgen.py")

NATIVE_READER = """
import hashlib, json, os, sys
from shufflefs.client import Client
with Client(sys.argv[1]) as c, c.open(sys.argv[2], "rb", buffering=0) as f:
    digest = hashlib.sha256(f.read()).hexdigest()
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
print(json.dumps({"sha256": digest, "open": open_files,
                  "netns": os.stat("/proc/self/ns/net").st_ino}))
"""


class Remote:
    def __init__(self, topology: RemoteCluster, mountpoint: Path, mount_pid: int) -> None:
        self.topology = topology
        self.mountpoint = mountpoint
        self.mount_pid = mount_pid
        self.processes = ProcessCluster(topology.local.dir, mountpoint)
        self.storage_dirs = [str(topology.local.storage_dir(i)) for i in range(1, 4)]

    def chunk_files_open(self, paths: list[str]) -> list[str]:
        return [p for p in paths if any(p.startswith(d) for d in self.storage_dirs)]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    why_not = namespaces_available()
    if why_not is not None:
        pytest.fail(f"the remote topology needs network namespaces: {why_not}")
    base = tmp_path_factory.mktemp("remote")
    topology = RemoteCluster(base, 3, 1, replicas=3, mgmtd_settings=dict(HEARTBEAT_FAST))
    with topology:
        pid = topology.mount(base / "mnt")
        r = Remote(topology, base / "mnt", pid)
        r.processes.all_serving()
        yield r


def test_reads_cross_the_network(remote: Remote) -> None:
    """The mount and a native client, both on the reader host, read every
    byte right and open no chunk file: no short circuit."""
    data = content(21, 6 * MiB + 1234)
    path = remote.mountpoint / "remote.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # past the page cache: to the mount process
    try:
        assert os.pread(fd, len(data) + 4096, 0) == data
    finally:
        os.close(fd)
    assert remote.chunk_files_open(open_files(remote.mount_pid)) == []
    netns = remote.topology.reader_netns()
    done = subprocess.run(
        [
            *enter_command(netns),
            sys.executable,
            "-c",
            NATIVE_READER,
            str(remote.topology.client_config),
            "/remote.bin",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    native = json.loads(done.stdout.splitlines()[-1])
    assert native["sha256"] == hashlib.sha256(data).hexdigest()
    assert native["netns"] == os.stat(f"{NETNS_DIR}/{netns}").st_ino  # it ran on the reader host
    assert native["netns"] != os.stat("/proc/self/ns/net").st_ino
    assert remote.chunk_files_open(native["open"]) == []
    # and the mount process itself runs on the reader host
    assert os.stat(f"/proc/{remote.mount_pid}/ns/net").st_ino == native["netns"]


def test_a_mount_on_a_reader_host_serves_metrics_at_its_own_address(remote: Remote) -> None:
    """The shared client config names the bridge's address for mounts'
    metrics, which a reader host cannot bind (RemoteCluster.mount passes no
    address of its own): the mount serves them at its own address toward
    mgmtd, and announces that one."""
    reader = remote.topology.hosts.address(remote.topology.storage_hosts + 1)
    assert reader not in remote.topology.client_config.read_text()

    def mount_url() -> str | None:
        mounts = [m for m in remote.processes.status()["clients"] if m["kind"] == "mount"]
        return mounts[0]["metrics"] if mounts else None

    wait_until("the mount's metrics announced", lambda: mount_url() is not None, timeout=30)
    url = mount_url()
    assert url is not None and urllib.parse.urlsplit(url).hostname == reader
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert "shufflefs_client_fast_reads_total" in reply.read().decode()


def received_from(netns: str) -> dict[str, int]:
    """Bytes host *netns* has received so far per peer address (`ss -ti`)."""
    out = subprocess.run(
        [*enter_command(netns), "ss", "-tinH"], capture_output=True, text=True, check=True
    ).stdout
    got: dict[str, int] = {}
    peer = ""
    for line in out.splitlines():
        if not line[:1].isspace():
            peer = line.split()[4].rsplit(":", 1)[0]
        else:
            for word in line.split():
                if word.startswith("bytes_received:"):
                    got[peer] = got.get(peer, 0) + int(word.split(":")[1])
    return got


def busiest_storage_host(remote: Remote, among: list[int]) -> int:
    """Which of the storage hosts *among* the reader host is reading from now."""
    hosts, netns = remote.topology.hosts, remote.topology.reader_netns()
    before = received_from(netns)
    time.sleep(1.0)
    after = received_from(netns)
    return max(
        among, key=lambda i: after.get(hosts.address(i), 0) - before.get(hosts.address(i), 0)
    )


def test_storage_host_killed_and_cut_during_remote_reads(remote: Remote, tmp_path: Path) -> None:
    """A checked O_DIRECT read loop on the reader host through its mount;
    the storage daemon it reads from is killed (-9), then the host it reads
    from next is cut off (its packets dropped): no read fails, every byte
    is right."""
    c = remote.processes
    hosts = remote.topology.hosts
    path = remote.mountpoint / "loop.bin"
    path.write_bytes(content(31, 24 * MiB))
    report = tmp_path / "reads.json"
    reader = subprocess.Popen(
        [
            *enter_command(remote.topology.reader_netns()),
            sys.executable,
            LOADGEN,
            "read",
            str(path),
            "31",
            "90",  # at most: stopped once it has read on after the cut
            str(report),
        ]
    )
    cut: int | None = None
    try:
        progress = Path(f"{report}.progress")
        wait_until(
            "the read loop under way",
            lambda: progress.exists() and int(progress.read_text() or 0) >= 20,
        )
        killed = busiest_storage_host(remote, [1, 2, 3])
        c.kill(f"storage{killed}")
        c.wait_for(
            f"storage{killed}'s target offline",
            lambda s: any(t["state"] == "offline" for t in s["targets"]),
        )
        cut = busiest_storage_host(remote, [i for i in (1, 2, 3) if i != killed])
        hosts.cut(cut)
        at_cut = int(progress.read_text() or 0)
        wait_until(
            "the read loop reading on after the cut",
            lambda: reader.poll() is not None or int(progress.read_text() or 0) >= at_cut + 200,
            timeout=90,
        )
        loadgen.stop(reader)
        assert reader.wait(120) == 0
    finally:
        if cut is not None:
            hosts.restore(cut)
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    result = json.loads(report.read_text())
    print(f"remote reads, storage{killed} killed then host {cut} cut: {result}")
    assert result["reads"] > 50
    assert result["failures"] == 0, result["errors"]
    assert result["wrong"] == 0
    # the READs were taken off the mount's event loop (fuse/fast_reads.py),
    # and the ones that met the dead or cut host were answered the usual way
    (mount,) = [m for m in c.status()["clients"] if m["kind"] == "mount"]
    assert total(mount["metrics"], "shufflefs_client_fast_reads", outcome="taken") > 50
    assert total(mount["metrics"], "shufflefs_client_fast_reads", outcome="fell_back") > 0
    c.restart_missing()
    c.all_serving()


def leftovers(tag: str, under: Path) -> list[str]:
    """Namespaces, links and processes of the bench run with this tag / dir."""
    names = ip("netns", "list", check=False).stdout + ip("-o", "link", check=False).stdout
    found = [w for w in names.split() if w.startswith(f"sfs{tag}h") or w.startswith(f"sfsbr{tag}")]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(under) in cmd:
                found.append(f"pid {entry}: {cmd[:200]}")
    found += [str(p) for p in under.iterdir()]
    return found


BENCH = [
    sys.executable,
    "-m",
    "shufflefs.cluster.cli",
    "bench",
    "--remote",
    "--storage-hosts",
    "2",
    "--replicas",
    "1",
    "--link-mbps",
    "100",
    "--size-mb",
    "8",
    "--seconds",
    "0.3",
    "--readers",
    "2",
    "--workloads",
    "rand4k",
    "--paths",
    "local,native-batch",
    "--no-cold",
]


def test_bench_remote_runs_and_leaves_nothing(tmp_path: Path) -> None:
    """A tiny `bench --remote` run (capped links, fio on the mount, two
    rounds) prints its rows and leaves no namespace, link, process or file
    behind."""
    done = subprocess.Popen(
        [*BENCH, "--json", "--rounds", "2", "--local-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = done.communicate(timeout=240)
    assert done.returncode == 0
    result = json.loads(out)
    rows = {(r["path"], r["readers"]): r for r in result["rows"]}
    assert rows[("native-batch", 2)]["iops"] > 0
    assert {(f["where"], f["jobs"]) for f in result["fio"]} == {
        ("shufflefs", 1),
        ("shufflefs", 8),
        ("local", 1),
        ("local", 8),
    }
    for f in result["fio"]:
        low, high = f["iops_range"]
        assert f["rounds"] == 2 and 0 < low <= f["iops"] <= high
        assert f["ratio_to_local"] > 0 and len(f["ratio_to_local_range"]) == 2
    assert leftovers(str(done.pid % 100000), tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_remote_interrupted_leaves_nothing(tmp_path: Path, sig: int) -> None:
    """Ctrl-C (or SIGTERM) once the topology is up and mounted: the run
    stops, exits non-zero and removes everything it made."""
    bench = subprocess.Popen(
        [*BENCH, "--no-fio", "--seconds", "30", "--local-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        wait_until(
            "the bench's mount",
            lambda: str(tmp_path) in Path("/proc/mounts").read_text() or bench.poll() is not None,
            timeout=120,
        )
        assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
        time.sleep(0.5)
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode != 0
    assert "Traceback" not in err, err
    assert str(tmp_path) not in Path("/proc/mounts").read_text()
    assert leftovers(str(bench.pid % 100000), tmp_path) == []
