"""The READ trampoline of fuse/read_inode.py finds what it patches or
leaves everything alone (the working case is tested on real mounts,
tests/e2e/test_mount_modes.py)."""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

import pytest

from shufflefs.fuse.read_inode import ReadInodes


@pytest.mark.parametrize(
    "path",
    [
        ctypes.util.find_library("c") or "libc.so.6",  # an ELF file without pyfuse3's symbols
        sys.executable,
        __file__,  # not an ELF file at all
        "/nonexistent/pyfuse3.so",
    ],
)
def test_install_without_pyfuse3_symbols_changes_nothing(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    if not Path(path).is_absolute():
        path = next(
            (
                str(p)
                for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
                if (p := Path(d) / path).exists()
            ),
            path,
        )
    reads = ReadInodes()
    with caplog.at_level(logging.WARNING, "shufflefs.fuse"):
        assert reads.available(path) is False
        assert reads.install(path) is False
    assert not reads.installed
    assert "READ hook unavailable" in caplog.text


def test_install_before_any_session_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    reads = ReadInodes()  # pyfuse3.init was not called in this process
    with caplog.at_level(logging.WARNING, "shufflefs.fuse"):
        assert reads.install() is False
    assert not reads.installed


def test_this_pyfuse3_build_has_what_the_trampoline_needs() -> None:
    """The build `make` installs (from source, with its symbol table): a
    cache=immutable mount serves reads by inode here (and in CI)."""
    assert ReadInodes().available()


def test_take_hands_out_the_inode_once() -> None:
    reads = ReadInodes(current=42)
    assert reads.take() == 42
    assert reads.take() == 0


@pytest.mark.parametrize(
    ("flags", "noflush"),
    [
        (os.O_RDONLY, True),
        (os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC, True),
        (os.O_WRONLY, False),
        (os.O_RDWR, False),
        (os.O_RDONLY | os.O_TRUNC, False),
    ],
)
def test_open_trampoline_asks_for_no_flush_on_read_only_opens(flags: int, noflush: bool) -> None:
    """A read-write mount's read-only opens set `noflush` (the eighth bit
    field after `flags` in libfuse 3's struct fuse_file_info) before
    pyfuse3's callback copies the file info; nothing else is touched."""
    seen: list[tuple[int, int, int]] = []
    info = (ctypes.c_uint32 * 10)()
    info[0] = flags
    info[1] = 0b101  # writepage and keep_cache, say: left as they are
    address = ctypes.addressof(info)
    hooks = ReadInodes(noflush_read_only=True)
    trampoline = hooks._open(lambda req, ino, fi: seen.append((req, ino, fi)))
    trampoline(7, 42, address)
    assert seen == [(7, 42, address)]
    assert info[0] == flags
    assert info[1] == (0b101 | 1 << 7 if noflush else 0b101)
    # a read-only mount's opens: nothing touched (it answers FLUSH ENOSYS once)
    info[1] = 0b101
    ReadInodes()._open(lambda req, ino, fi: None)(7, 42, address)
    assert info[1] == 0b101
