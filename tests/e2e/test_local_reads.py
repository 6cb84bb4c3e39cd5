"""Reads on a storage node's own host go straight to its chunk files (short
circuit): they must return exactly what the daemon would, including when a
replica's chunk file was damaged on disk."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
from clusters import ProcessCluster
from opsworld import metered_mount, total
from procfs import deleted_open_files

# they drop the kernel's caches, or count what those spare: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

MiB = 1 << 20


def test_damaged_local_replica_is_never_returned(mounted: ProcessCluster, mnt: Path) -> None:
    data = os.urandom(3 * MiB)
    p = mnt / "local-damage.bin"
    p.write_bytes(data)
    ino = p.stat().st_ino
    damaged = 0
    for target in sorted(mounted.data_dir.glob("storage*/target1")):
        files = sorted(target.glob(f"chunks/*/{ino:016x}*"))
        for f in files[:2]:  # damage two chunks on every replica but one
            if damaged >= 4:
                break
            with open(f, "r+b") as fh:
                fh.seek(12345)
                b = fh.read(1)
                fh.seek(12345)
                fh.write(bytes([b[0] ^ 0x5A]))
            damaged += 1
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        import mmap

        buf = mmap.mmap(-1, 64 << 10)
        rng = random.Random(1)
        for _ in range(200):
            off = rng.randrange(0, len(data) // 4096 - 16) * 4096
            n = os.preadv(fd, [memoryview(buf)[: 16 * 4096]], off)
            assert buf[:n] == data[off : off + n]
        for off in (0, MiB, 2 * MiB):  # the damaged blocks themselves
            n = os.preadv(fd, [memoryview(buf)[:16384]], off + 12288)
            assert buf[:n] == data[off + 12288 : off + 12288 + n]
    finally:
        os.close(fd)
    assert p.read_bytes() == data


def test_removed_chunks_are_not_held_open_by_the_reader(mounted: ProcessCluster, mnt: Path) -> None:
    """A short-circuit reader must not keep chunk files open after the file is
    closed: once the daemons delete them (unlink, overwrite), their space comes
    back. Held fds once kept a full target full after half its files were gone."""
    import time

    mount_pid = int((mounted.data_dir / "run" / "mount.pid").read_text())
    paths = [mnt / f"held-{i}.bin" for i in range(4)]
    for p in paths:
        p.write_bytes(os.urandom(2 * MiB + 17))
    for p in paths:
        p.read_bytes()
    with open(paths[0], "r+b") as f:  # copy-on-write replaces a committed chunk file
        f.write(b"overwritten")
    for p in paths[1:]:
        p.unlink()
    deadline = time.monotonic() + 30
    while True:  # the deletes reach the daemons through metadata GC
        held = deleted_open_files(mount_pid, mounted.data_dir)
        if not held:
            break
        assert time.monotonic() < deadline, f"mount still holds removed chunk files: {held}"
        time.sleep(0.2)
    paths[0].unlink()


def test_a_files_chunk_records_outlive_its_close(
    mounted: ProcessCluster, mnt: Path, tmp_path: Path
) -> None:
    """At a file's last close the short circuit closes its chunk files (the
    test above) but keeps its chunk records: an open the open cache answers
    (the file unchanged) reads them from memory, not from the target's
    table; an open that shows a change forgets them. Forgetting them at
    every close cost each warm sample of a loader ~3 µs of the mount's loop
    for nothing, and each later read a lookup in the table."""
    files = {mnt / f"records-{k:02d}.bin": os.urandom(50_000 + k) for k in range(12)}
    for p, data in files.items():
        p.write_bytes(data)
    family = "shufflefs_cache_lookups"
    (tmp_path / "ro").mkdir()
    with contextmanager(metered_mount)(mounted, tmp_path / "ro", "ro", family, "result") as m:
        misses = []
        for _ in range(2):
            Path("/proc/sys/vm/drop_caches").write_text("3\n")  # the READs reach the mount
            before = total(m.metrics, family, cache="record", result="miss")
            for p, data in files.items():
                assert (m.mountpoint / mnt.name / p.name).read_bytes() == data
            misses.append(total(m.metrics, family, cache="record", result="miss") - before)
    assert misses[0] >= len(files)  # each file's record read once
    assert misses[1] == 0  # and kept after its close
