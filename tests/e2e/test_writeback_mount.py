"""``-o writeback`` (fuse/writeback.py): a close of a written file returns
before its bytes are on the storage daemons, and the mount finishes the
close behind it.

Checked with real mounts of the shared cluster: closes return while every
storage daemon is stopped (SIGSTOP), and an fsync waits for them; the mount
reads and stats what it just closed; another mount reads every file whole
once the mount's closes are done; a truncating reopen waits for the close
behind, times set after the writes do not and are kept; an unmount (`shufflefs umount`) waits for
the mount process, which finishes the closes still owed first, also when
the storage daemons were stopped as it began; the owner, mode and times set
on an open file (tar x) go with its close; `shufflefs status` shows the
mode.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from clusters import (
    ProcessCluster,
    another_mount,
    mount_metrics_url,
    storage_stopped,
    wait_until,
)
from harness import owner_mode_mtime, shufflefs
from harness import read_whole as read
from opsworld import total

from shufflefs.cluster import procs
from shufflefs.cluster.metrics_scrape import counter_samples
from shufflefs.cluster.preflight import mounted_fstype
from shufflefs.fuse.mount import mount_processes
from shufflefs.fuse.writeback import closes_behind

SIZE = 110 * 1024
ANSWERS = "shufflefs_client_fast_answers"
STOPPED_MAX = 2.0  # s the storage daemons stay stopped: well under the heartbeat timeout


def mount_writeback(cluster: ProcessCluster, mountpoint: Path) -> None:
    shufflefs("mount", "--config", str(cluster.client_config), "-o", "writeback", str(mountpoint))


@pytest.fixture(scope="module")
def wmnt(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mountpoint = tmp_path_factory.mktemp("writeback-mount")
    mount_writeback(mounted, mountpoint)
    try:
        yield mountpoint
    finally:
        shufflefs("umount", str(mountpoint))


def closes(url: str) -> dict[str, int]:
    """The mount's writeback counters: started, done, failed."""
    samples = counter_samples(url, "shufflefs_client_writeback_total", "outcome")
    return {k: int(v) for k, v in samples.items()}


def settled(url: str) -> dict[str, int]:
    """The counters once every close started is done (or failed)."""
    wait_until("closes done", lambda: closes_behind(url) == 0)
    return closes(url)


class Call(threading.Thread):
    """*fn* in a thread, with the time it returned (None: not yet)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(target=self._run, args=(fn,))
        self.returned: float | None = None
        self.start()

    def _run(self, fn: Callable[[], object]) -> None:
        fn()
        self.returned = time.monotonic()

    def waiting_on_a_mount(self) -> bool:
        """Blocked in the kernel, waiting for a FUSE answer."""
        try:
            wchan = Path(f"/proc/self/task/{self.native_id}/wchan").read_text()
        except OSError:
            return False
        return wchan == "request_wait_answer"


def resumed_after(call: Call, blocked: Callable[[], bool], stopped: Callable[[], object]) -> float:
    """Once *call* is *blocked* (or returned), leave *stopped* (resume
    storage); the time storage resumed."""
    wait_until(
        "the call to block", lambda: call.returned is not None or blocked(), timeout=STOPPED_MAX
    )
    stopped()
    return time.monotonic()


WRITER = """
import sys
for i, p in enumerate(sys.argv[1:]):
    with open(p, "wb") as f:
        f.write(bytes([i % 251]) * SIZE)
""".replace("SIZE", str(SIZE))


def content(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


def test_status_shows_the_mode(mounted: ProcessCluster, wmnt: Path) -> None:
    out = shufflefs("status", "--json", "--config", str(mounted.client_config)).stdout
    listed = {m["mountpoint"]: m for m in json.loads(out)["mounts"]}
    assert listed[str(wmnt)]["mode"] == "writeback"


def test_closes_return_while_storage_is_stopped_and_fsync_waits(
    mounted: ProcessCluster, wmnt: Path, mnt: Path
) -> None:
    here = wmnt / mnt.name
    url = mount_metrics_url(mounted, wmnt)
    before = settled(url)
    paths = [str(here / f"f{i}") for i in range(5)]
    synced = here / "synced"
    syncing = threading.Event()

    def write_and_fsync() -> None:
        with open(synced, "wb") as f:
            f.write(b"s" * SIZE)
            f.flush()
            syncing.set()
            os.fsync(f.fileno())

    with ExitStack() as stopped:
        stopped.enter_context(storage_stopped(mounted))
        # every open, write and close returns with no storage daemon running
        subprocess.run([sys.executable, "-c", WRITER, *paths], check=True, timeout=STOPPED_MAX)
        now = closes(url)
        assert now["started"] - before["started"] == 5 and now["done"] == before["done"]
        syncer = Call(write_and_fsync)
        in_fsync = lambda: syncing.is_set() and syncer.waiting_on_a_mount()  # noqa: E731
        resumed = resumed_after(syncer, in_fsync, stopped.close)
    syncer.join(60)
    # an fsync waits for storage, as on every mount
    assert syncer.returned is not None and syncer.returned > resumed
    after = settled(url)
    assert after["failed"] == before["failed"]
    there = mnt  # the same directory through the session's default mount
    for i in range(5):
        assert read(there / f"f{i}") == content(i)
    assert read(there / "synced") == b"s" * SIZE


def test_the_mount_reads_what_it_just_closed_and_others_read_it_once_done(
    mounted: ProcessCluster, wmnt: Path, mnt: Path
) -> None:
    """... and its WRITEs (gone behind), FLUSHes and the RELEASEs of written
    files (their closes behind), and the kernel's GETXATTR of
    security.capability before each write (a new file has none), are
    answered in libfuse's callback (fuse/fast_answers.py), none a task on
    pyfuse3's loop."""
    here = wmnt / mnt.name
    url = mount_metrics_url(mounted, wmnt)
    ops = ("write", "flush", "release", "getxattr")
    answered = {op: total(url, ANSWERS, op=op) for op in ops}
    for i in range(30):
        p = here / f"g{i}"
        with open(p, "wb") as f:
            f.write(content(i)[: SIZE - i])
        assert p.stat().st_size == SIZE - i
        assert read(p) == content(i)[: SIZE - i]
    settled(url)
    for i in range(30):
        assert read(mnt / f"g{i}") == content(i)[: SIZE - i]
    for op, before in answered.items():
        # (a handle's first requests go the usual way until the file info's
        # handle offset was checked against pyfuse3's reading)
        assert total(url, ANSWERS, op=op) - before >= 25, op


def test_unmount_waits_for_the_closes_still_owed(
    mounted: ProcessCluster, mnt: Path, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "wb"
    mountpoint.mkdir()
    mount_writeback(mounted, mountpoint)
    [pid] = mount_processes(mountpoint)
    paths = [str(mountpoint / mnt.name / f"h{i}") for i in range(20)]
    with storage_stopped(mounted):
        subprocess.run([sys.executable, "-c", WRITER, *paths], check=True, timeout=STOPPED_MAX)
        unmounting = Call(lambda: shufflefs("umount", str(mountpoint)))
        wait_until(
            "the kernel to let go of the mount",
            lambda: mounted_fstype(mountpoint) is None,
            timeout=STOPPED_MAX,
        )
        # the process still owes the closes: it and the command wait
        assert unmounting.returned is None and procs.alive(pid)
        resumed = time.monotonic()
    unmounting.join(60)
    assert unmounting.returned is not None and unmounting.returned > resumed
    assert not procs.alive(pid)
    for i in range(20):
        assert read(mnt / f"h{i}") == content(i)


def test_a_truncating_reopen_comes_after_the_close_still_behind(
    mounted: ProcessCluster, wmnt: Path, mnt: Path
) -> None:
    p = wmnt / mnt.name / "f"
    url = mount_metrics_url(mounted, wmnt)

    def rewrite() -> None:
        with open(p, "wb") as f:  # O_TRUNC
            f.write(b"new")

    with ExitStack() as stopped:
        stopped.enter_context(storage_stopped(mounted))
        subprocess.run([sys.executable, "-c", WRITER, str(p)], check=True, timeout=STOPPED_MAX)
        waited = closes(url)["waited"]
        rewriting = Call(rewrite)
        # the open waits for the first close (the mount counts it)
        resumed = resumed_after(rewriting, lambda: closes(url)["waited"] > waited, stopped.close)
    rewriting.join(60)
    # it waited for the first close, which needed storage
    assert rewriting.returned is not None and rewriting.returned > resumed
    settled(url)
    assert read(mnt / "f") == b"new" and read(p) == b"new"


def test_times_set_after_the_writes_are_kept(
    mounted: ProcessCluster, wmnt: Path, mnt: Path
) -> None:
    """tar x sets a file's times after its close, cp -p on the open file:
    neither waits for the writes or the close behind, and the length report
    that comes later does not overwrite them with the time of the writes."""
    p = wmnt / mnt.name / "f"
    q = wmnt / mnt.name / "g"
    stamp = 1_500_000_000
    with storage_stopped(mounted):
        subprocess.run([sys.executable, "-c", WRITER, str(p)], check=True, timeout=STOPPED_MAX)

        def set_times() -> None:
            os.utime(p, (stamp, stamp))  # tar x: after the close
            with open(q, "wb") as f:  # cp -p: on the open file
                f.write(content(1))
                os.utime(f.fileno(), (stamp + 1, stamp + 1))

        # with the closes behind, and their writes, not waited for
        setting = threading.Thread(target=set_times)
        setting.start()
        setting.join(STOPPED_MAX / 2)
        assert not setting.is_alive()
    settled(mount_metrics_url(mounted, wmnt))
    assert int((mnt / "f").stat().st_mtime) == stamp == int(p.stat().st_mtime)
    assert int((mnt / "g").stat().st_mtime) == stamp + 1 == int(q.stat().st_mtime)
    assert read(mnt / "f") == content(0) and read(mnt / "g") == content(1)


def test_owner_mode_and_times_set_on_an_open_file_go_with_its_close(
    mounted: ProcessCluster, mnt: Path, tmp_path: Path
) -> None:
    """tar x (and cp -a) sets each file's owner, mode and times while it
    holds it open: on a writeback mount these go with the file's close
    (client/fs.py `setattr_behind`), answered in libfuse's callback, so they
    return while the metadata server and storage are stopped; the mount shows
    them at once, another mount once the close is done."""
    mountpoint = tmp_path / "wb"
    mountpoint.mkdir()
    # (attr_timeout: the kernel's permission check of the chown is answered
    # from what the mount holds of the file however slow this machine is)
    with another_mount(mounted, mountpoint, "writeback,attr_timeout=30"):
        p = mountpoint / mnt.name / "tarred"
        stamp = 1_400_000_000
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, content(3))

            def set_attributes() -> None:
                os.fchown(fd, 1234, 5678)
                os.fchmod(fd, 0o640)
                os.utime(fd, (stamp, stamp))

            url = mount_metrics_url(mounted, mountpoint)
            answered = total(url, ANSWERS, op="setattr")
            with storage_stopped(mounted, "meta"):
                # with the metadata server stopped, not waited for
                setting = Call(set_attributes)
                setting.join(STOPPED_MAX / 2)
                assert setting.returned is not None
                st = os.fstat(fd)
                assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
                assert int(st.st_mtime) == stamp
        finally:
            os.close(fd)
        # in libfuse's callback (fuse/fast_answers.py), none a task on pyfuse3's loop
        assert total(url, ANSWERS, op="setattr") - answered == 3
        settled(url)
        for seen in (mnt / "tarred", p):
            assert owner_mode_mtime(seen) == (1234, 5678, 0o640, stamp), seen
            assert seen.stat().st_size == SIZE
        assert read(mnt / "tarred") == content(3)


def test_tar_x_keeps_every_owner_mode_and_time(
    mounted: ProcessCluster, wmnt: Path, mnt: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "set.tar"
    members = [
        (f"m{i}", 0o600 + i % 3 * 0o40, 1000 + i, 2000 + i, 1_300_000_000 + i) for i in range(12)
    ]
    with tarfile.open(archive, "w") as tar:
        for i, (name, mode, uid, gid, mtime) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid, info.mtime = SIZE - i, mode, uid, gid, mtime
            tar.addfile(info, io.BytesIO(content(i)[: SIZE - i]))
    target = wmnt / mnt.name / "untarred"
    target.mkdir()
    subprocess.run(["tar", "xf", str(archive), "-C", str(target)], check=True, timeout=60)
    settled(mount_metrics_url(mounted, wmnt))
    for i, (name, mode, uid, gid, mtime) in enumerate(members):
        for seen in (mnt / "untarred" / name, target / name):
            st = seen.stat()
            assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, uid, gid), seen
            assert int(st.st_mtime) == mtime and st.st_size == SIZE - i, seen
        assert read(mnt / "untarred" / name) == content(i)[: SIZE - i]
