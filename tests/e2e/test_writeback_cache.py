"""``-o writeback_cache``: the kernel's writeback cache on a read-write mount
(docs/operations.md): small write(2)s gather in the kernel's page cache and
reach the mount as a few page-sized WRITEs when the file is closed, another
mount sees every byte once the close returned, and a write into part of a
page of an existing file, opened write-only, has the kernel read that page
through the write-only handle first (the mount serves it). The POSIX and
model suites run on such a mount too (`writable_mnt`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, wait_until
from harness import read_whole as read
from opsworld import MeteredMount, metered_mount

from shufflefs.cluster.metrics_scrape import counter_samples
from shufflefs.fuse.writeback import closes_behind

FAMILY = "shufflefs_client_fast_answers"


@pytest.fixture(scope="module")
def wbc(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MeteredMount]:
    options = "writeback,writeback_cache"
    yield from metered_mount(mounted, tmp_path_factory.mktemp("wbc"), options, FAMILY, "op")


def closes_started(m: MeteredMount) -> int:
    return int(counter_samples(m.metrics, "shufflefs_client_writeback_total", "outcome")["started"])


def settled(m: MeteredMount, started_before: int, closes: int) -> None:
    """Its *closes* closes (begun at the kernel's RELEASE, which comes after
    close(2) returned: counted from *started_before*) done behind: what
    another mount sees from then on."""
    wait_until(
        "closes done",
        lambda: closes_started(m) >= started_before + closes and closes_behind(m.metrics) == 0,
    )


def test_small_writes_reach_the_mount_as_a_few_and_are_seen_elsewhere(
    wbc: MeteredMount, mnt: Path
) -> None:
    d = wbc.mountpoint / mnt.name
    block = bytes(range(256)) * 4  # 1 KiB
    writes = wbc.count("write")
    started = closes_started(wbc)
    for i in range(5):
        with open(d / f"f{i}", "wb", buffering=0) as f:
            for k in range(100):
                assert f.write(block[k % 7 :] + block[: k % 7]) == len(block)
    # 100 write(2)s a file: without the kernel's cache, 100 WRITEs each
    # (answered in libfuse's callback: they go behind)
    assert wbc.count("write") - writes <= 5 * 2
    settled(wbc, started, 5)
    for i in range(5):
        want = b"".join(block[k % 7 :] + block[: k % 7] for k in range(100))
        assert read(mnt / f"f{i}") == want  # another mount, after the close
        assert os.stat(d / f"f{i}").st_size == len(want)


def test_part_of_a_page_written_through_a_write_only_handle(wbc: MeteredMount, mnt: Path) -> None:
    """The kernel fills the rest of the page from the file first: a READ on
    the write-only handle."""
    original = os.urandom(3 * 4096 + 100)
    (mnt / "old").write_bytes(original)
    started = closes_started(wbc)
    fd = os.open(wbc.mountpoint / mnt.name / "old", os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"0123456789", 5000) == 10
        assert os.pwrite(fd, b"tail", len(original) - 2) == 4  # past the end, in the last page
    finally:
        os.close(fd)
    want = bytearray(original)
    want[5000:5010] = b"0123456789"
    want[len(original) - 2 :] = b"tail"
    settled(wbc, started, 1)
    assert read(mnt / "old") == bytes(want)
    assert read(wbc.mountpoint / mnt.name / "old") == bytes(want)
