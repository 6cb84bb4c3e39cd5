"""An unlinked file open read-only on one mount keeps its data across a
metadata server kill -9: the server held that handle in memory only, and
learns it back from the mount's next session renewal; until every session
has re-reported, nothing is freed (docs/metadata.md, "Read-only handles").

A read-write mount's cached opens, kept fresh by its cache watch instead of
a round trip per open (metadata/cache_watch.py), stay close-to-open when the
mount is stopped while another one writes, and across a metadata server
kill -9."""

from __future__ import annotations

import mmap
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, chunk_files, mount_pid, wait_until
from harness import read_whole as read
from harness import rewrite_in_place, shufflefs

CHUNK = 1 << 20
LEASE = 6.0  # the metadata server's session_timeout here: mounts renew every 2 s

pytestmark = pytest.mark.e2e


@pytest.fixture
def two_mounts(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ProcessCluster, Path, Path]]:
    """A cluster, its mount and a second one (with the mount options the
    test is parametrized with, if any)."""
    options = getattr(request, "param", [])
    c = ProcessCluster(tmp_path / "c", tmp_path / "a", storage_nodes=1)
    with open(c.data_dir / "meta" / "meta.toml", "a") as f:
        f.write(f"session_timeout = {LEASE}\n")
    second = tmp_path / "b"
    second.mkdir()
    c.up()
    try:
        shufflefs("mount", "--config", str(c.client_config), *options, str(second))
        try:
            yield c, c.mountpoint, second
        finally:
            shufflefs("umount", str(second))
    finally:
        c.down()


def test_unlinked_read_only_file_survives_meta_kill9(
    two_mounts: tuple[ProcessCluster, Path, Path],
) -> None:
    c, a, b = two_mounts
    data = os.urandom(3 * CHUNK + 77)
    (b / "sample.bin").write_bytes(data)  # written through B: nothing of it cached on A
    ino = (a / "sample.bin").stat().st_ino
    copies = len(chunk_files(c.data_dir, ino))
    assert copies == 4  # 4 chunks, one replica
    fd = os.open(a / "sample.bin", os.O_RDONLY)
    try:
        os.unlink(b / "sample.bin")
        assert not (b / "sample.bin").exists()
        log_before = len(c.log("meta"))
        c.kill("meta")
        c.restart_missing()
        # both mounts renew (A reporting its read-only handle): the grace ends
        wait_until(
            "the restart grace to end", lambda: "restart grace over" in c.log("meta")[log_before:]
        )
        # the sweep at the grace's end is the one place the inode could be freed
        # while A holds it: it freed nothing (no other orphan exists here)
        [over] = [
            ln for ln in c.log("meta")[log_before:].splitlines() if "restart grace over" in ln
        ]
        assert over.rstrip().endswith("freed=0"), over
        assert len(chunk_files(c.data_dir, ino)) == copies
        assert os.pread(fd, len(data) + 10, 0) == data
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    wait_until("the chunks to be deleted", lambda: not chunk_files(c.data_dir, ino))


def read_direct(p: Path, size: int) -> bytes:
    """O_DIRECT: the READs reach the mount (no page cache answers them)."""
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, size + 4096)
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        os.close(fd)


@pytest.mark.parametrize("two_mounts", [["-o", "cache=immutable"]], indirect=True)
def test_immutable_mount_reads_through_a_meta_kill9(
    two_mounts: tuple[ProcessCluster, Path, Path],
) -> None:
    """cache=immutable keeps a handle by inode for every file it read (no
    opens are seen): it is reported to a restarted metadata server like any
    read-only handle, so a file removed elsewhere keeps its data within the
    linger; a file first read after the restart opens on the new server."""
    c, a, b = two_mounts
    read_before, first_after = os.urandom(2 * CHUNK + 5), os.urandom(CHUNK + 9)
    (a / "read-before").write_bytes(read_before)
    (a / "first-after").write_bytes(first_after)
    assert read_direct(b / "read-before", len(read_before)) == read_before
    ino = (a / "read-before").stat().st_ino
    copies = len(chunk_files(c.data_dir, ino))
    os.unlink(a / "read-before")
    log_before = len(c.log("meta"))
    c.kill("meta")
    c.restart_missing()
    wait_until(
        "the restart grace to end", lambda: "restart grace over" in c.log("meta")[log_before:]
    )
    [over] = [ln for ln in c.log("meta")[log_before:].splitlines() if "restart grace over" in ln]
    assert over.rstrip().endswith("freed=0"), over
    assert len(chunk_files(c.data_dir, ino)) == copies
    assert read_direct(b / "read-before", len(read_before)) == read_before
    assert read_direct(b / "first-after", len(first_after)) == first_after
    assert (b / "first-after").read_bytes() == first_after


def test_watched_cache_stays_close_to_open_with_a_stopped_reader_and_a_meta_kill9(
    two_mounts: tuple[ProcessCluster, Path, Path],
) -> None:
    c, a, b = two_mounts
    size = 100_000
    (a / "f").write_bytes(b"1" * size)
    assert read(b / "f") == b"1" * size
    assert read(b / "f") == b"1" * size  # B's open now comes from its cache
    # B stopped: A's close waits for B's acknowledgement at most B's lease,
    # then goes on; B, woken, no longer trusts its cache
    pid = mount_pid(c, b)
    os.kill(pid, signal.SIGSTOP)
    try:
        rewrite_in_place(a / "f", b"2" * size)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert read(b / "f") == b"2" * size
    assert read(b / "f") == b"2" * size
    # the metadata server killed and restarted: what its watcher told B is
    # lost with it; the new one makes A's close wait out B's lease (or B's
    # acknowledgement of the new watcher) before it returns
    c.kill("meta")
    c.restart_missing()
    rewrite_in_place(a / "f", b"3" * size)
    assert read(b / "f") == b"3" * size
    rewrite_in_place(a / "f", b"4" * size)  # and once the watch is back
    assert read(b / "f") == b"4" * size
