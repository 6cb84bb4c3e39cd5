"""Through a real FUSE mount: files, directories, big files, tools."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

CHUNK = 1 << 20


def test_write_read_append_truncate(mnt: Path) -> None:
    p = mnt / "a.txt"
    p.write_bytes(b"hello")
    with open(p, "ab") as f:
        f.write(b" world")
    assert p.read_bytes() == b"hello world"
    os.truncate(p, 5)
    assert p.read_bytes() == b"hello"
    os.truncate(p, 8)
    assert p.read_bytes() == b"hello\0\0\0"
    assert p.stat().st_size == 8


def test_directories(mnt: Path) -> None:
    (mnt / "d" / "e").mkdir(parents=True)
    (mnt / "d" / "f").write_text("x")
    assert sorted(os.listdir(mnt / "d")) == ["e", "f"]
    with pytest.raises(OSError) as info:
        os.rmdir(mnt / "d")
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileExistsError):
        (mnt / "d").mkdir()
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "d" / "f")
    with pytest.raises(OSError) as info:
        (mnt / ("n" * 256)).write_text("x")
    assert info.value.errno == errno.ENAMETOOLONG


def test_many_chunks_random_reads(mnt: Path) -> None:
    rng = random.Random(7)
    data = rng.randbytes(5 * CHUNK + 12345)
    p = mnt / "big.bin"
    p.write_bytes(data)
    assert p.stat().st_size == len(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        for _ in range(300):
            off = rng.randrange(0, len(data))
            n = rng.randrange(1, 3 * CHUNK)
            assert os.pread(fd, n, off) == data[off : off + n]
    finally:
        os.close(fd)
    assert hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_overwrite_in_the_middle(mnt: Path) -> None:
    p = mnt / "o.bin"
    data = bytearray(os.urandom(3 * CHUNK))
    p.write_bytes(data)
    fd = os.open(p, os.O_RDWR)
    try:
        for off in (0, 4095, CHUNK - 10, 2 * CHUNK + 77):
            patch = os.urandom(5000)
            os.pwrite(fd, patch, off)
            data[off : off + len(patch)] = patch
    finally:
        os.close(fd)
    assert p.read_bytes() == bytes(data)


def test_numpy_memmap(mnt: Path) -> None:
    arr = np.arange(3 * CHUNK // 4, dtype=np.uint32)
    p = mnt / "arr.u32"
    arr.tofile(p)
    mm = np.memmap(p, dtype=np.uint32, mode="r")
    assert mm.shape == arr.shape
    idx = np.random.default_rng(0).integers(0, len(arr), 1000)
    assert np.array_equal(mm[idx], arr[idx])
    del mm
    rw = np.memmap(p, dtype=np.uint32, mode="r+")
    rw[10:20] = 7
    rw.flush()
    del rw
    back = np.fromfile(p, dtype=np.uint32)
    assert (back[10:20] == 7).all() and back[9] == 9 and back[20] == 20


def _reader(path: str, seed: int, n: int) -> str:
    rng = random.Random(seed)
    size = os.path.getsize(path)
    expected = Path(path).read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(n):
            off = rng.randrange(0, size - 4096)
            if os.pread(fd, 4096, off) != expected[off : off + 4096]:
                return f"mismatch at {off}"
    finally:
        os.close(fd)
    return "ok"


def test_several_processes_reading(mnt: Path) -> None:
    p = mnt / "shared.bin"
    p.write_bytes(os.urandom(4 * CHUNK))
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_reader, [(str(p), seed, 300) for seed in range(4)])
    assert results == ["ok"] * 4


def test_unlink_open_file_keeps_data(mnt: Path) -> None:
    p = mnt / "ghost.bin"
    data = os.urandom(2 * CHUNK + 5)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.unlink(p)
        assert not p.exists()
        assert os.pread(fd, len(data), 0) == data
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)


def test_symlink_hardlink_rename(mnt: Path) -> None:
    (mnt / "t").write_text("target")
    os.symlink("t", mnt / "s")
    assert os.readlink(mnt / "s") == "t"
    assert (mnt / "s").read_text() == "target"
    os.link(mnt / "t", mnt / "h")
    assert (mnt / "t").stat().st_nlink == 2
    os.rename(mnt / "h", mnt / "h2")
    assert (mnt / "h2").read_text() == "target"
    (mnt / "other").write_text("other")
    os.rename(mnt / "other", mnt / "t")
    assert (mnt / "t").read_text() == "other"
    assert (mnt / "h2").read_text() == "target"
    assert (mnt / "h2").stat().st_nlink == 1


def test_xattrs(mnt: Path) -> None:
    p = mnt / "x"
    p.write_text("x")
    os.setxattr(p, "user.k", b"v1")
    assert os.getxattr(p, "user.k") == b"v1"
    with pytest.raises(FileExistsError):
        os.setxattr(p, "user.k", b"v2", os.XATTR_CREATE)
    with pytest.raises(OSError) as info:
        os.setxattr(p, "user.missing", b"v2", os.XATTR_REPLACE)
    assert info.value.errno == errno.ENODATA
    assert "user.k" in os.listxattr(p)
    os.removexattr(p, "user.k")
    with pytest.raises(OSError) as info:
        os.getxattr(p, "user.k")
    assert info.value.errno == errno.ENODATA


def test_chmod_utimens(mnt: Path) -> None:
    p = mnt / "m"
    p.write_text("m")
    os.chmod(p, 0o640)
    assert p.stat().st_mode & 0o777 == 0o640
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = p.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)


def test_cp_tar_git(mnt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    for i in range(20):
        (src / "sub" / f"f{i}").write_bytes(os.urandom(random.randrange(0, 300_000)))
    (src / "sub" / "deep" / "x").write_text("deep")
    os.symlink("sub/deep/x", src / "link")
    subprocess.run(["cp", "-a", str(src), str(mnt / "copy")], check=True)
    subprocess.run(["diff", "-r", "--no-dereference", str(src), str(mnt / "copy")], check=True)

    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname="src")
    (mnt / "untar").mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(mnt / "untar")], check=True)
    subprocess.run(
        ["diff", "-r", "--no-dereference", str(src), str(mnt / "untar" / "src")], check=True
    )
    subprocess.run(
        ["tar", "-cf", str(tmp_path / "b.tar"), "-C", str(mnt / "untar"), "src"], check=True
    )

    repo = mnt / "repo"
    repo.mkdir()
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@x",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@x",
        "HOME": str(tmp_path),
    }
    git = shutil.which("git")
    assert git, "git is needed for this test"
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "first"]):
        if cmd[0] == "add":
            shutil.copytree(src, repo / "content", symlinks=True)
        subprocess.run([git, *cmd], cwd=repo, check=True, env=env)
    log = subprocess.run(
        [git, "log", "--oneline"], cwd=repo, check=True, env=env, capture_output=True, text=True
    )
    assert "first" in log.stdout
    subprocess.run([git, "fsck", "--strict"], cwd=repo, check=True, env=env, capture_output=True)


def test_overlapping_writes_land_in_order(mnt: Path) -> None:
    """Writes go out behind the caller; those to one chunk must still apply in
    the order they were made."""
    p = mnt / "order.bin"
    model = bytearray(3 * CHUNK)
    rng = random.Random(11)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for i in range(300):
            off = rng.choice((0, CHUNK - 3000, CHUNK + 100, 2 * CHUNK - 1)) + rng.randrange(0, 2000)
            data = bytes([i % 251]) * rng.randrange(1, 6000)
            data = data[: 3 * CHUNK - off]
            os.pwrite(fd, data, off)
            model[off : off + len(data)] = data
    finally:
        os.close(fd)
    assert p.read_bytes()[: len(model)] == bytes(model[: p.stat().st_size])


def test_reads_see_own_writes_before_close(mnt: Path) -> None:
    p = mnt / "own.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        data = os.urandom(5 * CHUNK)
        os.write(fd, data)
        direct = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            import mmap

            buf = mmap.mmap(-1, 8192)
            n = os.preadv(direct, [buf], 4 * CHUNK)
            assert buf[:n] == data[4 * CHUNK : 4 * CHUNK + n] and n == 8192
        finally:
            os.close(direct)
    finally:
        os.close(fd)
