"""An unlinked file open read-only on one mount keeps its data across a
metadata server kill -9: the server held that handle in memory only, and
learns it back from the mount's next session renewal; until every session
has re-reported, nothing is freed (docs/metadata.md, "Read-only handles")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, chunk_files, wait_until
from harness import shufflefs

CHUNK = 1 << 20
LEASE = 6.0  # the metadata server's session_timeout here: mounts renew every 2 s

pytestmark = pytest.mark.e2e


@pytest.fixture
def two_mounts(tmp_path: Path) -> Iterator[tuple[ProcessCluster, Path, Path]]:
    c = ProcessCluster(tmp_path / "c", tmp_path / "a", storage_nodes=1)
    with open(c.data_dir / "meta" / "meta.toml", "a") as f:
        f.write(f"session_timeout = {LEASE}\n")
    second = tmp_path / "b"
    second.mkdir()
    c.up()
    try:
        shufflefs("mount", "--config", str(c.client_config), str(second))
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
