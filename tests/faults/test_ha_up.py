"""No single point of failure: `shufflefs up --ha` (3 etcd members, 3 mgmtd
on them, 3 metadata servers, the storage nodes and the mount), then, with
reads and a namespace storm running on the mount: kill -9 of the mgmtd
primary, then kill -9 of the metadata primary. The mount carries on without
an error: the metadata primary's lease lives in etcd (cluster/meta_leases.py),
so the new mgmtd primary renews it or grants it anew with the next epoch.
Every acknowledged create is there, and the cluster still reacts to a
storage daemon's death afterwards. The stall of each kill is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from clusters import HEARTBEAT_FAST, ProcessCluster
from harness import shufflefs

from shufflefs.cluster.launcher import mgmtd_name

STORM = str(Path(__file__).parent / "meta_storm.py")
STORM_SECONDS = 9.0
READ_FILES = 16


def status(c: ProcessCluster) -> dict[str, Any] | None:
    """`status --json`, or None while no mgmtd answers (a failover)."""
    result = shufflefs("status", "--json", "--config", str(c.client_config), check=False)
    if result.returncode != 0:
        return None
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def wait_status(c: ProcessCluster, what: str, check: Any, timeout: float = 30.0) -> Any:
    """Poll the status until *check(status)* gives something true; returns it."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        last = status(c)
        found = check(last) if last is not None else None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {json.dumps(last)[:2000]}")


def mgmtd_primary(c: ProcessCluster, s: dict[str, Any]) -> str | None:
    """The service name of the mgmtd instance that says it is the primary."""
    names = {
        f"{c.layout.host}:{port}": mgmtd_name(i)
        for i, port in enumerate([c.layout.mgmtd_port, *c.layout.mgmtd_ports], start=1)
    }
    primaries = [names[m["address"]] for m in s["mgmtd"] if m["role"] == "primary"]
    assert len(primaries) <= 1, primaries
    return primaries[0] if primaries else None


def meta_primary(c: ProcessCluster, s: dict[str, Any]) -> tuple[str, int] | None:
    """(service name, epoch) of the running metadata server named primary."""
    running = {pid: name for name in ("meta", "meta2", "meta3") if (pid := c.pid(name))}
    for n in s["nodes"]:
        if n["kind"] == "meta" and n.get("role") == "primary" and n["pid"] in running:
            return running[n["pid"]], int(n["epoch"])
    return None


class Reader(threading.Thread):
    """Reads the files of *directory* in turn until stopped: every error and
    the longest read of the current phase."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.reads = 0
        self.longest = 0.0

    def phase(self) -> float:
        """The longest read since the last call (and start a new phase)."""
        longest, self.longest = self.longest, 0.0
        return longest

    def run(self) -> None:
        i = 0
        while not self.stop.is_set() and len(self.errors) < 20:
            i += 1
            path = self.directory / f"r{i % READ_FILES}"
            t0 = time.monotonic()
            try:
                if path.read_bytes() != content(i % READ_FILES):
                    self.errors.append(f"{path.name}: wrong content")
            except OSError as exc:
                self.errors.append(f"{path.name}: {exc}")
            self.longest = max(self.longest, time.monotonic() - t0)
            self.reads += 1
            time.sleep(0.01)


def content(i: int) -> bytes:
    return (b"read file %04d\n" % i) * 4000  # ~60 KB: data through the storage chain


def storm_during(c: ProcessCluster, name: str, tmp_path: Path, kill: Any) -> tuple[Any, float]:
    """A namespace storm in mnt/*name*; once it is going, *kill()*. Returns
    the storm's report and the seconds from the kill to the storm's end."""
    report = tmp_path / f"{name}.json"
    storm = subprocess.Popen(
        [sys.executable, STORM, str(c.mountpoint / name), str(STORM_SECONDS), str(report)]
    )
    try:
        deadline = time.monotonic() + 30
        progress = Path(f"{report}.progress")
        while time.monotonic() < deadline:
            if progress.exists() and int(progress.read_text() or 0) >= 30:
                break
            time.sleep(0.05)
        kill()
        assert storm.wait(timeout=60) == 0
    finally:
        if storm.poll() is None:
            storm.kill()
            storm.wait()
    return json.loads(report.read_text()), time.monotonic()


def check_storm(directory: Path, result: dict[str, Any]) -> None:
    assert result["errors"] == [], result["errors"]
    model = result["model"]
    assert sorted(p.name for p in directory.iterdir()) == sorted(model)
    for name, i in model.items():
        assert (directory / name).read_bytes() == (b"%08d" % i) * (64 + i % 200)


def test_up_ha_mgmtd_then_metadata_primary_killed_under_load(tmp_path: Path) -> None:
    c = ProcessCluster(
        tmp_path / "data", tmp_path / "mnt", ha=True, meta_servers=3, mgmtd_settings=HEARTBEAT_FAST
    )
    reader: Reader | None = None
    try:
        c.up()
        s = wait_status(c, "a metadata primary", lambda s: meta_primary(c, s) and s)
        assert sorted(m["role"] for m in s["mgmtd"]) == ["primary", "standby", "standby"]
        assert all(c.pid(f"etcd{i}") for i in (1, 2, 3))
        reads = c.mountpoint / "reads"
        reads.mkdir()
        for i in range(READ_FILES):
            (reads / f"r{i}").write_bytes(content(i))
        reader = Reader(reads)
        reader.start()

        # 1. kill -9 the mgmtd primary while the storm runs
        old_mgmtd = mgmtd_primary(c, s)
        assert old_mgmtd is not None
        _, old_epoch = meta_primary(c, s) or ("", 0)
        reader.phase()
        result_a, _ = storm_during(c, "a", tmp_path, lambda: c.kill(old_mgmtd))
        read_a = reader.phase()
        s = wait_status(c, "a new mgmtd primary", lambda s: mgmtd_primary(c, s) and s)
        new_mgmtd = mgmtd_primary(c, s)
        assert new_mgmtd != old_mgmtd
        check_storm(c.mountpoint / "a", result_a)

        # 2. kill -9 the metadata primary: the new mgmtd grants the lease
        #    through etcd, with an epoch above every earlier one
        victim, epoch_before = wait_status(c, "a metadata primary", lambda s: meta_primary(c, s))
        assert epoch_before >= old_epoch
        result_b, _ = storm_during(c, "b", tmp_path, lambda: c.kill(victim))
        read_b = reader.phase()
        new_meta, epoch_after = wait_status(
            c, "a new metadata primary", lambda s: meta_primary(c, s)
        )
        assert new_meta != victim and epoch_after > epoch_before
        assert "metadata primary is node" in c.log(new_mgmtd)
        check_storm(c.mountpoint / "b", result_b)
        reader.stop.set()
        reader.join(10)
        assert reader.errors == [] and reader.reads > 100
        print(
            f"HA STALL: kill -9 mgmtd primary ({old_mgmtd}): longest namespace op "
            f"{result_a['stall']:.2f}s, longest read {read_a:.2f}s, metadata epoch "
            f"{old_epoch} -> {epoch_before}; kill -9 metadata primary "
            f"({victim}, epoch {epoch_before} -> {epoch_after} from {new_mgmtd}): longest "
            f"namespace op {result_b['stall']:.2f}s, longest read {read_b:.2f}s; "
            f"{result_a['ops'] + result_b['ops']} namespace ops, {reader.reads} reads"
        )

        # 3. the new mgmtd primary still reacts to a dead storage daemon
        c.kill("storage1")
        t0 = time.monotonic()
        wait_status(
            c,
            "storage1's target offline",
            lambda s: any(t["state"] == "offline" for t in s["targets"]),
        )
        print(
            f"HA: after both kills, a dead storage daemon's target offline in "
            f"{time.monotonic() - t0:.1f}s"
        )
    finally:
        if reader is not None:
            reader.stop.set()
            reader.join(10)
        c.down()
