"""open_cached: a file is opened only when its path is in the kernel's
dentry cache (openat2 with RESOLVE_CACHED), else None, never a wait for
the disk."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from shufflefs.storage import cached_open
from shufflefs.storage.cached_open import open_cached


def _supported(path: Path) -> None:
    fd = open_cached(str(path), os.O_RDONLY)
    if fd is None:
        pytest.skip("no openat2 with RESOLVE_CACHED here")
    os.close(fd)


def test_a_cached_path_opens_and_a_cached_absence_is_enoent(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"bytes of a chunk")
    _supported(path)
    fd = open_cached(str(path), os.O_RDWR | os.O_CLOEXEC)
    assert fd is not None
    try:
        assert os.pread(fd, 100, 0) == b"bytes of a chunk"
    finally:
        os.close(fd)
    missing = tmp_path / "gone"
    assert not missing.exists()  # (the lookup leaves a negative dentry)
    with pytest.raises(FileNotFoundError):
        open_cached(str(missing), os.O_RDONLY)


@pytest.mark.usefixtures("kernel_caches")
def test_a_path_the_kernel_dropped_is_not_looked_up(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping the dentry cache needs root")
    path = tmp_path / "chunk"
    path.write_bytes(b"x")
    _supported(path)
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert open_cached(str(path), os.O_RDONLY) is None
    assert path.read_bytes() == b"x"  # an ordinary open looks it up
    fd = open_cached(str(path), os.O_RDONLY)
    assert fd is not None
    os.close(fd)


def test_where_openat2_is_missing_the_caller_is_told_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"x")
    monkeypatch.setattr(cached_open, "_syscall", None)
    assert open_cached(str(path), os.O_RDONLY) is None


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL])
def test_a_kernel_without_it_is_asked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """No openat2 (ENOSYS), or one without RESOLVE_CACHED (EINVAL, Linux
    5.6 to 5.11): None, and the call is never made again."""
    calls: list[int] = []

    def refused(*args: object) -> int:
        calls.append(1)
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(cached_open, "_syscall", refused)
    assert open_cached(str(tmp_path / "chunk"), os.O_RDONLY) is None
    assert open_cached(str(tmp_path / "chunk"), os.O_RDONLY) is None
    assert calls == [1]
