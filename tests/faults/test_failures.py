"""Failures with replication factor 3, storage nodes on their own test hosts.

Every test runs a bounded load (reads checked byte for byte, writes logged
when acknowledged) while a node is killed, cut off, corrupted or filled, and
then checks: no read failed or returned wrong bytes, every acknowledged file
is intact, and once the node is back every replica of every chunk is
identical (versions and CRC-32C of every block compared across replicas).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import loadgen
import pytest
from clusters import ProcessCluster, assert_replicas_identical, mount_metrics_url, wait_until
from harness import flip, shufflefs
from loadgen import content

from shufflefs.cluster import procs
from shufflefs.cluster.metrics_scrape import counter_samples
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

WORKERS = str(Path(__file__).parent.parent / "loadgen.py")
LOAD_SECONDS = 90.0  # at most: the tests stop the load once it has run on after the fault
MiB = 1 << 20


def start_reader(path: Path, seed: int, seconds: float, report: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, WORKERS, "read", str(path), str(seed), str(seconds), str(report)]
    )


def start_writer(directory: Path, seconds: float, acklog: Path) -> subprocess.Popen[bytes]:
    directory.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, WORKERS, "write", str(directory), str(seconds), str(acklog)]
    )


def reads_so_far(report: Path) -> int:
    try:
        return int(Path(f"{report}.progress").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def under_way(report: Path | None = None, acklog: Path | None = None) -> None:
    """Wait (up to 60 s) until the load has started: the reader has read and
    the writer has had files acknowledged, so a fault lands in the middle of it."""
    deadline = time.monotonic() + 60
    while (report is not None and reads_so_far(report) < 20) or (
        acklog is not None and (not acklog.exists() or len(acked(acklog)) < 3)
    ):
        assert time.monotonic() < deadline, "the load did not get going"
        time.sleep(0.1)


def finish(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    assert proc.wait(timeout) == 0, "load process failed"


def reads_on(report: Path, reads: int = 100) -> None:
    """Wait until the reader has done *reads* more reads (after a fault)."""
    start = reads_so_far(report)
    wait_until(f"{reads} more reads", lambda: reads_so_far(report) >= start + reads)


def acks_after(acklog: Path, when: float, count: int = 3) -> None:
    """Wait until *count* files were acknowledged after *when* (time.time())."""
    wait_until(
        f"{count} writes acknowledged after the fault",
        lambda: len([f for f in acked(acklog) if f[2] > when]) >= count,
    )


def reader_report(report: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(report.read_text())
    print(f"reader: {result}")
    return result


def acked(acklog: Path) -> list[tuple[str, str, float]]:
    out = []
    for line in acklog.read_text().splitlines():
        if not line.startswith("ERROR"):
            path, digest, when = line.split()
            out.append((path, digest, float(when)))
    return out


def check_acked(acklog: Path) -> int:
    files = acked(acklog)
    for path, digest, _ in files:
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest, path
    return len(files)


def write_dataset(cluster: ProcessCluster, name: str, size: int, seed: int) -> Path:
    path = cluster.mountpoint / name
    path.write_bytes(content(seed, size))
    return path


def test_kill9_storage_during_reads(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    data = write_dataset(c, "reads.bin", 48 * MiB, seed=11)
    reader = start_reader(data, 11, LOAD_SECONDS, tmp_path / "r.json")
    under_way(report=tmp_path / "r.json")
    c.kill("storage2")
    detected = c.wait_for(
        "storage2's target offline", lambda s: any(t["state"] == "offline" for t in s["targets"])
    )
    reads_on(tmp_path / "r.json")
    loadgen.stop(reader)
    finish(reader)
    r = reader_report(tmp_path / "r.json")
    assert r["reads"] > 100 and r["failures"] == 0 and r["wrong"] == 0
    print(
        f"FAILOVER kill -9: longest read stall {r['longest_s'] * 1000:.0f} ms; "
        f"mgmtd marked the node offline {detected:.1f}s after the kill"
    )
    c.restart_missing()
    c.all_serving()
    assert_replicas_identical(c)


def test_kill9_during_writes_then_resync(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    acklog = tmp_path / "acked.log"
    writer = start_writer(c.mountpoint / "w", LOAD_SECONDS, acklog)
    under_way(acklog=acklog)
    kill_time = time.time()
    c.kill("storage3")
    c.wait_for(
        "storage3's target offline", lambda s: any(t["state"] == "offline" for t in s["targets"])
    )
    acks_after(acklog, max(time.time(), kill_time + 1))
    loadgen.stop(writer)
    finish(writer)
    after_kill = [f for f in acked(acklog) if f[2] > kill_time + 1]
    assert after_kill, "no write was acknowledged after the failover"
    n = check_acked(acklog)
    t0 = time.monotonic()
    c.restart_missing()
    waited = c.all_serving()
    print(
        f"RESYNC: storage3 back and serving after {time.monotonic() - t0:.1f}s "
        f"(state wait {waited:.1f}s); {n} acknowledged files intact"
    )
    chunks = assert_replicas_identical(c)
    assert chunks > 0
    check_acked(acklog)


def test_kill9_storage_under_writeback(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    """A writer on a ``-o writeback`` mount (closes finish behind it) while a
    storage node is killed: no close behind fails (the mount's counter), and
    every file whose close returned, before or after the kill, is whole on
    another mount once the mount's closes are done."""
    from shufflefs.fuse.writeback import closes_behind

    c = fault_cluster
    wb = tmp_path / "wb"
    wb.mkdir()
    shufflefs("mount", "--config", str(c.client_config), "-o", "writeback", str(wb))
    try:
        url = mount_metrics_url(c, wb)
        acklog = tmp_path / "acked.log"
        writer = start_writer(wb / "w", LOAD_SECONDS, acklog)
        under_way(acklog=acklog)
        kill_time = time.time()
        c.kill("storage3")
        c.wait_for(
            "storage3's target offline",
            lambda s: any(t["state"] == "offline" for t in s["targets"]),
        )
        acks_after(acklog, max(time.time(), kill_time + 1))
        loadgen.stop(writer)
        finish(writer)
        wait_until("the closes behind done", lambda: closes_behind(url) == 0)
        failed = counter_samples(url, "shufflefs_client_writeback_total", "outcome")["failed"]
        assert failed == 0
        files = acked(acklog)
        assert any(f[2] > kill_time + 1 for f in files), "no close returned after the failover"
        for path, digest, _ in files:  # read through the cluster's own mount
            theirs = c.mountpoint / Path(path).relative_to(wb)
            assert hashlib.sha256(theirs.read_bytes()).hexdigest() == digest, path
        print(f"WRITEBACK kill -9 of a storage daemon: {len(files)} files whole elsewhere")
    finally:
        shufflefs("umount", str(wb))
    c.restart_missing()
    c.all_serving()


def test_kill9_every_storage_daemon_keeps_acknowledged_writes(
    fault_cluster: ProcessCluster, tmp_path: Path
) -> None:
    """Group flushes (docs/storage.md): with three writers' files flushed and
    committed in shared batches, kill -9 every storage daemon at once in the
    middle of the writes; every file acknowledged before is then, on each
    replica's own disk (read back from the target directory, as the daemon
    would at its restart), whole and committed: no write was acknowledged
    before every replica had flushed and committed it."""
    c = fault_cluster
    logs = [tmp_path / f"acked{i}.log" for i in range(3)]
    writers = [start_writer(c.mountpoint / f"w{i}", 8.0, log) for i, log in enumerate(logs)]
    wait_until(
        "the writers to get going",
        lambda: sum(len(acked(log)) for log in logs if log.exists()) >= 10,
    )
    names = [n for n in c.names() if n.startswith("storage")]
    pids = [c.pid(n) for n in names]
    for pid in pids:
        assert pid is not None
        procs.signal_pid(pid, signal.SIGKILL)
    killed_at = time.time()
    for pid in pids:
        assert pid is not None and procs.wait_exit(pid, 15.0)
    files = [f for log in logs for f in acked(log) if f[2] < killed_at]
    stores = [ChunkStore(p.parent) for p in sorted(c.data_dir.rglob("target.json"))]
    assert len(stores) == len(names) == 3  # replicas 3: every target holds every chunk
    try:
        for path, digest, _ in files:
            st = os.stat(path)  # the metadata server and the mount are still up
            chunk = 1 << 20
            for store in stores:
                data = b"".join(
                    bytes(store.read(chunk_id(st.st_ino, i), 0, chunk))
                    for i in range(-(-st.st_size // chunk))
                )
                assert hashlib.sha256(data).hexdigest() == digest, (path, store.path)
    finally:
        for store in stores:
            store.close()
    print(f"GROUP FLUSH kill -9 of every storage daemon: {len(files)} acknowledged files whole")
    c.restart_missing()
    for w in writers:
        finish(w)
    c.all_serving()
    assert sum(check_acked(log) for log in logs) >= len(files)


def test_cut_host_during_reads_and_writes(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    if c.hosts is None:
        pytest.fail("network namespaces are unavailable here: cannot cut a host's link")
    data = write_dataset(c, "cut.bin", 32 * MiB, seed=5)
    reader = start_reader(data, 5, LOAD_SECONDS, tmp_path / "r.json")
    acklog = tmp_path / "acked.log"
    writer = start_writer(c.mountpoint / "w", LOAD_SECONDS, acklog)
    under_way(report=tmp_path / "r.json", acklog=acklog)
    cut_time = time.time()
    c.hosts.cut(1)
    c.wait_for("host 1 offline", lambda s: any(t["state"] == "offline" for t in s["targets"]))
    acks_after(acklog, max(time.time(), cut_time + 5))
    reads_on(tmp_path / "r.json")
    loadgen.stop(reader, writer)
    finish(reader)
    finish(writer)
    r = reader_report(tmp_path / "r.json")
    assert r["failures"] == 0 and r["wrong"] == 0
    assert [f for f in acked(acklog) if f[2] > cut_time + 5], "no write acknowledged after the cut"
    n = check_acked(acklog)
    print(f"FAILOVER cut: longest read stall {r['longest_s'] * 1000:.0f} ms; {n} files intact")
    c.hosts.restore(1)
    c.all_serving()
    assert_replicas_identical(c)
    check_acked(acklog)


def chunk_files_of(cluster: ProcessCluster, name: str) -> list[Path]:
    ino = (cluster.mountpoint / name).stat().st_ino
    return sorted(cluster.local.dir.glob(f"storage1/target1/chunks/*/{ino:016x}*"))


@pytest.mark.usefixtures("kernel_caches")  # drops them
def test_corruption_is_never_returned_and_repaired(
    fault_cluster: ProcessCluster, tmp_path: Path
) -> None:
    c = fault_cluster
    data = write_dataset(c, "corrupt.bin", 4 * MiB, seed=9)
    files = chunk_files_of(c, "corrupt.bin")
    assert len(files) == 4
    flip(files[0], 100)
    flip(files[1], 5000)
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")  # the daemon must read the disk
    reader = start_reader(data, 9, 3.0, tmp_path / "r.json")
    finish(reader)
    r = reader_report(tmp_path / "r.json")
    assert r["failures"] == 0 and r["wrong"] == 0
    # scrub finds whatever the reads did not already repair, and repairs it
    flip(files[2], 70000)
    result = shufflefs("scrub", "--json", "--config", str(c.config), check=False)
    report = json.loads(result.stdout)
    print(f"scrub: {report}")
    assert report["chunks_checked"] >= 12
    assert report["corrupt_found"] >= 1 and report["repaired"] >= 1
    assert report["unrecoverable"] == 0 and result.returncode == 0
    logs = "".join(p.read_text() for p in c.local.logs.glob("storage*.log"))
    assert "checksum" in logs.lower() or "corrupt" in logs.lower()
    assert data.read_bytes() == content(9, 4 * MiB)
    assert_replicas_identical(c)


def test_two_of_three_down(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    data = write_dataset(c, "last.bin", 8 * MiB, seed=3)
    existing = c.mountpoint / "existing.bin"
    existing.write_bytes(b"before")
    c.kill("storage1")
    c.kill("storage2")
    c.wait_for(
        "two targets offline",
        lambda s: sum(t["state"] == "offline" for t in s["targets"]) == 2,
    )
    reader = start_reader(data, 3, 3.0, tmp_path / "r.json")
    finish(reader)
    r = reader_report(tmp_path / "r.json")
    assert r["reads"] > 10 and r["failures"] == 0 and r["wrong"] == 0
    with pytest.raises(OSError) as info, open(existing, "r+b") as f:  # chain below min_replicas
        f.write(b"after!")
    assert info.value.errno == errno.EROFS
    with pytest.raises(OSError) as info:  # and a new file, which has no chain to go to
        (c.mountpoint / "refused.bin").write_bytes(b"x" * 100)
    assert info.value.errno == errno.EROFS
    assert existing.read_bytes() == b"before"
    c.restart_missing()
    c.all_serving()
    (c.mountpoint / "accepted.bin").write_bytes(b"y" * 100)
    assert (c.mountpoint / "accepted.bin").read_bytes() == b"y" * 100
    assert data.read_bytes() == content(3, 8 * MiB)
    assert_replicas_identical(c)


def test_full_target(tmp_path: Path) -> None:
    """One target on a small tmpfs: writes get ENOSPC cleanly, nothing written is lost."""
    cluster = ProcessCluster(
        tmp_path / "data", tmp_path / "mnt", mgmtd_settings={"heartbeat_interval": 0.5}
    )
    small = cluster.data_dir / "storage3" / "target1"
    small.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(small)], check=True)
    try:
        mnt = cluster.mountpoint
        cluster.up()
        written: list[tuple[Path, bytes]] = []
        code = None
        for i in range(200):
            data = os.urandom(2 * MiB)
            p = mnt / f"f{i}"
            try:
                p.write_bytes(data)
            except OSError as exc:
                code = exc.errno
                break
            written.append((p, data))
        assert code == errno.ENOSPC, f"expected ENOSPC, got {code}"
        assert len(written) >= 5
        for p, data in written:
            assert p.read_bytes() == data

        def small_target_free() -> int:
            (target,) = [t for t in cluster.status()["targets"] if t["path"] == str(small)]
            return int(target["free"])

        deadline = time.monotonic() + 10  # usage reaches status with the next heartbeats
        while small_target_free() >= 8 * MiB:
            assert time.monotonic() < deadline, "status never showed the target full"
            time.sleep(0.3)
        for p, _ in written[: len(written) // 2]:
            p.unlink()
        deadline = time.monotonic() + 20
        while True:  # space comes back once the deletes reach the storage daemons
            try:
                (mnt / "after.bin").write_bytes(b"z" * MiB)
                break
            except OSError as exc:
                assert exc.errno == errno.ENOSPC and time.monotonic() < deadline
                time.sleep(0.5)
        for p, data in written[len(written) // 2 :]:
            assert p.read_bytes() == data
    finally:
        cluster.down()
        subprocess.run(["umount", "-l", str(small)], check=False)
