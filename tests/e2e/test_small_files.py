"""Small-file ingestion through the mount: create, write, close, many at once.

A close makes the file's length visible to every other mount (close-to-open)
at once; fsync makes it durable (it survives a kill -9 of the metadata
server); many concurrent writers, some unlinking files they still hold open
for writing (handles are held in the metadata server's memory), leave a
namespace that passes fsck. One single-replica cluster for the module, and a
second mount of it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from clusters import ProcessCluster, another_mount, mount_metrics_url, wait_until
from harness import owner_mode_mtime, shufflefs
from opsworld import total

from shufflefs.metadata.process import NAMESPACE_DIR
from shufflefs.metadata.store import NamespaceStore

SIZE = 110 << 10


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    base = tmp_path_factory.mktemp("small-files")
    c = ProcessCluster(base / "data", base / "mnt", storage_nodes=1, replicas=1)
    with c.running(serving=False):
        yield c


@pytest.fixture(scope="module")
def other(single: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with another_mount(single, tmp_path_factory.mktemp("small-files-second")) as mountpoint:
        yield mountpoint


def content(i: int, size: int = SIZE) -> bytes:
    return random.Random(i).randbytes(size)


def test_length_right_after_close_on_another_mount(single: ProcessCluster, other: Path) -> None:
    d = single.mountpoint / "ctoo"
    d.mkdir()
    for i in range(20):
        size = SIZE + 977 * i
        with open(d / f"{i}.bin", "wb") as f:
            f.write(content(i, size))
        seen = other / "ctoo" / f"{i}.bin"
        assert seen.stat().st_size == size, i  # no waiting: the close reported it
        assert seen.read_bytes() == content(i, size), i
    # an existing file extended and closed: the new length, at once
    with open(d / "0.bin", "ab") as f:
        f.write(b"tail")
    assert (other / "ctoo" / "0.bin").read_bytes() == content(0) + b"tail"


def test_a_create_spares_its_directory_getattr(single: ProcessCluster, other: Path) -> None:
    """The kernel drops a directory's cached attributes on every create in
    it and asks for them before the next one: the create's reply carried
    them, so that getattr costs no metadata round trip, and they are the
    directory's as the server has them (the other mount sees the same)."""
    meta = next(n["metrics"] for n in single.status()["nodes"] if n["kind"] == "meta")
    d = single.mountpoint / "spared"
    d.mkdir()
    before = total(meta, "shufflefs_rpc_requests", method="getattr")
    for i in range(20):
        (d / f"{i}.bin").write_bytes(content(i, 1000))
    assert total(meta, "shufflefs_rpc_requests", method="getattr") - before < 10
    created = d.stat().st_mtime_ns
    assert created == (other / "spared").stat().st_mtime_ns
    os.unlink(d / "0.bin")  # any other mutation drops them: the next stat asks again
    assert d.stat().st_mtime_ns > created
    assert sorted(os.listdir(other / "spared")) == sorted(f"{i}.bin" for i in range(1, 20))


def test_an_unlink_spares_its_directory_getattr(single: ProcessCluster, other: Path) -> None:
    """As a create: the kernel drops a directory's cached attributes on
    every unlink in it and asks for them before the next one (``rm -r``: a
    round trip per file); the unlink's reply carried them, and they are the
    directory's as the server has them."""
    meta = next(n["metrics"] for n in single.status()["nodes"] if n["kind"] == "meta")
    d = single.mountpoint / "removed"
    d.mkdir()
    for i in range(20):
        (d / f"{i}.bin").write_bytes(content(i, 100))
    os.listdir(d)
    before = total(meta, "shufflefs_rpc_requests", method="getattr")
    for i in range(20):
        os.unlink(d / f"{i}.bin")
    assert total(meta, "shufflefs_rpc_requests", method="getattr") - before < 10
    assert d.stat().st_mtime_ns == (other / "removed").stat().st_mtime_ns
    assert os.listdir(other / "removed") == []


def test_a_writers_flush_carries_the_release_of_its_previous_file(
    single: ProcessCluster, other: Path
) -> None:
    """One writer's files one after another: each close's length report is
    a `close_files` entry that keeps its handle (no `update_length`), and
    the kernel's RELEASE of the previous file, which waits for it, goes in
    the same call; each length is seen by the other mount at once."""
    meta = next(n["metrics"] for n in single.status()["nodes"] if n["kind"] == "meta")
    d = single.mountpoint / "carried"
    d.mkdir()

    def calls() -> tuple[float, float]:
        return (
            total(meta, "shufflefs_rpc_requests", method="update_length"),
            total(meta, "shufflefs_rpc_requests", method="close_files"),
        )

    before = calls()
    files = 30
    for i in range(files):
        with open(d / f"{i}.bin", "wb") as f:
            f.write(content(i, 5000 + i))
        assert (other / "carried" / f"{i}.bin").stat().st_size == 5000 + i
    wait_until("the reports", lambda: calls()[1] - before[1] >= files)
    after = calls()
    assert after[0] == before[0]  # no update_length
    assert files <= after[1] - before[1] < 2 * files  # releases rode with reports


def test_many_concurrent_writers_then_fsck(single: ProcessCluster, other: Path) -> None:
    root = single.mountpoint / "storm"
    writers, files = 8, 25
    for w in range(writers):
        (root / f"w{w}").mkdir(parents=True)

    def writer(w: int) -> list[str]:
        removed = []
        for n in range(files):
            i = w * 1000 + n
            name = root / f"w{w}" / f"{n}.bin"
            with open(name, "w+b") as f:
                f.write(content(i)[: SIZE // 2])
                if n % 7 == 3:  # unlinked while still open for writing: stays writable
                    name.unlink()
                    removed.append(name.name)
                f.write(content(i)[SIZE // 2 :])
                if n % 7 == 3:
                    f.flush()
                    assert os.pread(f.fileno(), SIZE + 1, 0) == content(i)
        return removed

    with ThreadPoolExecutor(writers) as pool:
        removed = list(pool.map(writer, range(writers)))
    for w in range(writers):
        names = sorted(p.name for p in (other / "storm" / f"w{w}").iterdir())
        expected = sorted({f"{n}.bin" for n in range(files)} - set(removed[w]))
        assert names == expected
        for name in names:
            data = (other / "storm" / f"w{w}" / name).read_bytes()
            assert data == content(w * 1000 + int(name.split(".")[0])), (w, name)

    # the cluster stopped cleanly (mounts closed their sessions): fsck, strict
    # (before any metadata restart in this module: a restart's grace defers
    # frees to the sweep at its end, see docs/metadata.md)
    shufflefs("umount", str(other))
    single.down()
    with NamespaceStore(single.data_dir / "meta" / "db" / NAMESPACE_DIR, map_size=1 << 30) as ns:
        assert ns.fsck() == []
        assert ns.read_only.count() == 0
        counts = ns.counts()
    assert counts["handles"] == 0
    single.up()
    shufflefs("mount", "--config", str(single.client_config), str(other))


def test_fsync_is_durable_across_a_metadata_kill(single: ProcessCluster, other: Path) -> None:
    """(Last: the kill starts a restart grace.)"""
    path = single.mountpoint / "synced.bin"
    with open(path, "wb") as f:
        f.write(content(7))
        f.flush()
        os.fsync(f.fileno())
        single.kill("meta")  # kill -9 with the file still open for writing
        single.restart_missing()
        assert (other / "synced.bin").stat().st_size == SIZE
        f.write(b"more")
    wait_until("the length after the restart", lambda: path.stat().st_size == SIZE + 4)
    assert (other / "synced.bin").read_bytes() == content(7) + b"more"


def test_attributes_set_behind_land_across_a_metadata_kill(
    single: ProcessCluster, other: Path, tmp_path: Path
) -> None:
    """On a writeback mount the owner, mode and times set on an open file go
    with its close (client/fs.py `setattr_behind`): with the metadata server
    killed (-9) before the close and started again after it, the close
    behind still lands them, and no close fails. (Last, after the other
    kill: the restart grace it starts does not matter here.)"""
    from shufflefs.cluster.metrics_scrape import counter_samples
    from shufflefs.fuse.writeback import closes_behind

    wb = tmp_path / "wb"
    wb.mkdir()
    with another_mount(single, wb, "writeback,attr_timeout=30"):
        url = mount_metrics_url(single, wb)
        stamp = 1_350_000_000
        fd = os.open(wb / "owned.bin", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, content(9))
            os.fchown(fd, 4321, 8765)
            os.fchmod(fd, 0o604)
            os.utime(fd, (stamp, stamp))
            single.kill("meta")
        finally:
            os.close(fd)  # returns at once: the close is behind
        single.restart_missing()
        wait_until("the closes behind done", lambda: closes_behind(url) == 0, timeout=60)
        assert counter_samples(url, "shufflefs_client_writeback_total", "outcome")["failed"] == 0
        assert owner_mode_mtime(other / "owned.bin") == (4321, 8765, 0o604, stamp)
        assert (other / "owned.bin").stat().st_size == SIZE
        assert (other / "owned.bin").read_bytes() == content(9)
