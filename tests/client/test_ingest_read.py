"""The import reads a cached source file on the event loop (`_read_cached`,
``RWF_NOWAIT``) and leaves anything else to the worker thread's read."""

from __future__ import annotations

import os
from pathlib import Path

from shufflefs.client.ingest import _read_cached


def test_a_cached_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "sample.jpg"
    data = os.urandom(110_000)
    path.write_bytes(data)
    assert _read_cached(os.fsencode(path), len(data)) == data


def test_a_file_not_in_the_page_cache_is_left_to_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "cold.bin"
    data = os.urandom(300_000)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # clean pages, so the kernel drops them when asked
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert _read_cached(os.fsencode(path), len(data)) is None


def test_a_file_shorter_than_listed_or_gone_is_left_to_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "shrank.bin"
    path.write_bytes(b"x" * 1000)
    assert _read_cached(os.fsencode(path), 5000) is None  # listed at 5,000 bytes
    assert _read_cached(os.fsencode(tmp_path / "gone"), 10) is None
