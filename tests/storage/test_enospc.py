"""A target on a small tmpfs: running out of space fails writes cleanly with
ENOSPC (nothing committed, nothing left behind) and leaves every chunk
written before readable; the reserve refuses writes before the disk is full."""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

MiB = 1 << 20
CHUNK = MiB

pytestmark = pytest.mark.e2e  # mounts a tmpfs (root, the mount command)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mnt)], check=True)  # busy: detach anyway


def files(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file()}


def check_all(store: ChunkStore, acked: dict[bytes, bytearray]) -> None:
    for cid, data in acked.items():
        assert bytes(store.read(cid, 0, CHUNK)) == data
    assert store.stats()["used"] == sum(len(d) for d in acked.values())
    assert files(store.path) == {os.path.basename(store.file_path(c) or "") for c in acked}


@pytest.mark.parametrize("checked", [True, False], ids=["checked-up-front", "real-enospc"])
def test_disk_full_fails_cleanly(
    small_fs: Path,
    checked: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """checked: the free-space check refuses the write before any I/O.
    real-enospc: the check is bypassed (as when other writers or other users of
    the filesystem take the space between check and write), so pwrite, fsync
    or the LMDB commit meet the full disk themselves."""
    rng = random.Random(3)
    root = small_fs / "t"
    acked: dict[bytes, bytearray] = {}
    caplog.set_level(logging.WARNING, logger="shufflefs.storage")
    with ChunkStore(root, block_size=4096, fsync=True, reserve_bytes=0) as store:
        if not checked:
            monkeypatch.setattr(store, "_check_space", lambda needed: None)
        failures = 0
        ino = 1
        while failures < 6:
            cid = chunk_id(ino, 0)
            have = acked.get(cid, bytearray())
            n = min(rng.randrange(20_000, 300_000), CHUNK - len(have))
            data = rng.randbytes(n)
            try:
                store.write(cid, len(have), CHUNK, data)
            except FsError as exc:
                assert exc.errno == errno.ENOSPC, exc
                failures += 1
                check_all(store, acked)  # nothing of the failed write is visible
                ino += 1  # next time a new chunk (the create path fails too)
                continue
            acked.setdefault(cid, bytearray()).extend(data)
            if len(acked[cid]) == CHUNK:
                ino += 1
        assert sum(len(d) for d in acked.values()) > 4 * MiB
        out_of_space = [r for r in caplog.records if "out of space" in r.getMessage()]
        assert bool(out_of_space) != checked
        # tiny appends into partly filled pages need no data space, only metadata:
        # each either commits or fails cleanly, whichever layer meets the full disk
        partial = [c for c, d in acked.items() if len(d) % 4096]
        for i in range(100):
            cid = partial[i % len(partial)]
            try:
                store.write(cid, len(acked[cid]), CHUNK, b"+")
            except FsError as exc:
                assert exc.errno == errno.ENOSPC, exc
            else:
                acked[cid].extend(b"+")
        check_all(store, acked)
        # an overwrite needs a whole new copy of the chunk: it fails the same way
        victim = next(iter(acked))
        with pytest.raises(FsError) as info:
            store.write(victim, 10, CHUNK, b"over")
        assert info.value.errno == errno.ENOSPC
        check_all(store, acked)
        # freeing space makes writes work again
        freed = [c for c in acked if int.from_bytes(c[:8], "big") <= 2]
        for c in freed:
            store.remove_file(int.from_bytes(c[:8], "big"))
            del acked[c]
        cid = chunk_id(1000, 0)
        store.write(cid, 0, CHUNK, b"after" * 1000)
        acked[cid] = bytearray(b"after" * 1000)
        check_all(store, acked)
    with ChunkStore(root, block_size=4096, fsync=True, reserve_bytes=0) as store:  # restart
        check_all(store, acked)


def test_reserve_refuses_before_the_disk_is_full(small_fs: Path) -> None:
    root = small_fs / "t"
    with ChunkStore(root, block_size=4096, fsync=True, reserve_bytes=6 * MiB) as store:
        acked: dict[bytes, bytearray] = {}
        ino = 1
        with pytest.raises(FsError) as info:
            while True:
                cid = chunk_id(ino, 0)
                store.write(cid, 0, CHUNK, bytes([ino]) * (256 << 10))
                acked[cid] = bytearray(bytes([ino]) * (256 << 10))
                ino += 1
        assert info.value.errno == errno.ENOSPC and "reserved" in info.value.strerror
        st = os.statvfs(root)
        assert st.f_bavail * st.f_frsize >= 6 * MiB  # the reserve was kept
        assert store.stats()["free"] < 256 << 10
        check_all(store, acked)
