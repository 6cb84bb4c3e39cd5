"""Reads on a storage node's own host go straight to its chunk files (short
circuit): they must return exactly what the daemon would, including when a
replica's chunk file was damaged on disk."""

from __future__ import annotations

import os
import random
from pathlib import Path

from conftest import Mounted

MiB = 1 << 20


def test_damaged_local_replica_is_never_returned(mounted: Mounted, mnt: Path) -> None:
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
