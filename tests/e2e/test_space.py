"""Space: what statfs reports, and chunks freed when the last holder lets go."""

from __future__ import annotations

import os
import time
from pathlib import Path

from clusters import ProcessCluster, chunk_files

from shufflefs.cluster.launcher import LocalCluster

CHUNK = 1 << 20
SLACK = 1 << 30  # free space is reported by heartbeat: allow for what changed since


def replicas(data_dir: Path) -> int:
    return LocalCluster(data_dir).layout().replicas


def wait_until_gone(data_dir: Path, ino: int, timeout: float = 10.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while True:
        left = chunk_files(data_dir, ino)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_statfs(mounted: ProcessCluster, mnt: Path) -> None:
    st = os.statvfs(mnt)
    disk = os.statvfs(mounted.data_dir)
    assert st.f_namemax == 255
    assert st.f_frsize > 0 and st.f_bsize > 0
    assert st.f_blocks > 0 and st.f_bavail > 0 and st.f_bfree >= st.f_bavail
    assert st.f_blocks * st.f_frsize <= disk.f_blocks * disk.f_frsize
    assert st.f_bavail * st.f_frsize <= disk.f_bavail * disk.f_frsize + SLACK
    assert st.f_files > 0 and 0 < st.f_ffree <= st.f_files
    # any path inside the mount gives the same answer
    (mnt / "f").write_bytes(b"x")
    inner = os.statvfs(mnt / "f")
    assert (inner.f_blocks, inner.f_namemax) == (st.f_blocks, st.f_namemax)


def test_unlinked_open_file_chunks_freed_after_last_close(
    mounted: ProcessCluster, mnt: Path
) -> None:
    p = mnt / "ghost.bin"
    data = os.urandom(3 * CHUNK + 77)
    p.write_bytes(data)
    ino = p.stat().st_ino
    copies = 4 * replicas(mounted.data_dir)  # 4 chunks, on every replica
    assert len(chunk_files(mounted.data_dir, ino)) == copies
    first = os.open(p, os.O_RDONLY)
    second = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert os.pread(first, len(data), 0) == data
        os.close(first)
        # one holder left: the data must still be there and usable
        assert len(chunk_files(mounted.data_dir, ino)) == copies
        os.pwrite(second, b"still writable", 5)
        assert os.pread(second, 14, 5) == b"still writable"
    finally:
        os.close(second)
    assert wait_until_gone(mounted.data_dir, ino) == []


def test_unlinked_closed_file_chunks_freed(mounted: ProcessCluster, mnt: Path) -> None:
    p = mnt / "plain.bin"
    p.write_bytes(os.urandom(2 * CHUNK))
    ino = p.stat().st_ino
    assert len(chunk_files(mounted.data_dir, ino)) == 2 * replicas(mounted.data_dir)
    os.unlink(p)
    assert wait_until_gone(mounted.data_dir, ino) == []


def test_file_replaced_by_rename_is_freed(mounted: ProcessCluster, mnt: Path) -> None:
    (mnt / "old").write_bytes(os.urandom(CHUNK + 1))
    ino = (mnt / "old").stat().st_ino
    (mnt / "new").write_bytes(b"replacement")
    os.rename(mnt / "new", mnt / "old")
    assert wait_until_gone(mounted.data_dir, ino) == []


def test_shrink_cuts_chunks(mounted: ProcessCluster, mnt: Path) -> None:
    p = mnt / "shrink.bin"
    data = os.urandom(4 * CHUNK)
    p.write_bytes(data)
    ino = p.stat().st_ino
    r = replicas(mounted.data_dir)
    assert len(chunk_files(mounted.data_dir, ino)) == 4 * r
    os.truncate(p, CHUNK + 10)
    deadline = time.monotonic() + 10
    while len(chunk_files(mounted.data_dir, ino)) > 2 * r and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(chunk_files(mounted.data_dir, ino)) == 2 * r
    assert p.read_bytes() == data[: CHUNK + 10]
