"""The import reads a cached source file of a local filesystem on the event
loop (`_read_cached`, ``RWF_NOWAIT``) and leaves anything else to the worker
thread's read; the bytes its files in flight hold are bounded (`ByteBudget`)."""

from __future__ import annotations

import os
from pathlib import Path

import trio
from clusters import wait_until

from shufflefs.client.ingest import LOCAL_FSTYPES, ByteBudget, _read_cached, local_devices
from shufflefs.cluster.preflight import mount_of


def test_a_cached_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "sample.jpg"
    data = os.urandom(110_000)
    path.write_bytes(data)
    assert _read_cached(os.fsencode(path), len(data)) == data


def test_a_file_not_in_the_page_cache_is_left_to_the_thread(tmp_path: Path) -> None:
    """(The kernel may keep a page the advice cannot drop at that moment, one
    another CPU holds or a readahead our own attempt started is filling: the
    file is dropped and tried again until it was dropped whole. A
    `_read_cached` that read through a miss never passes.)"""
    path = tmp_path / "cold.bin"
    data = os.urandom(300_000)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # clean pages, so the kernel drops them when asked
    answers: list[bytearray | None] = []

    def dropped_and_left() -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        answers.append(_read_cached(os.fsencode(path), len(data)))
        return answers[-1] is None

    wait_until("a read of the dropped file left to the thread", dropped_and_left, timeout=10)
    assert all(a is None or a == data for a in answers)  # a whole read, else none


def test_a_file_shorter_than_listed_or_gone_is_left_to_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "shrank.bin"
    path.write_bytes(b"x" * 1000)
    assert _read_cached(os.fsencode(path), 5000) is None  # listed at 5,000 bytes
    assert _read_cached(os.fsencode(tmp_path / "gone"), 10) is None


def test_only_files_on_local_filesystems_are_read_on_the_loop(tmp_path: Path) -> None:
    """`local_devices` lists the mounts of local filesystems from mountinfo:
    not NFS, not a FUSE mount (a shufflefs one included), not a line it
    cannot parse."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "29 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "30 29 0:23 / /dev/shm rw shared:2 - tmpfs tmpfs rw\n"
        "31 29 0:52 / /data rw,relatime shared:3 - nfs4 server:/data rw,vers=4.2\n"
        "32 29 0:53 / /mnt/other rw,nosuid shared:4 - fuse.shufflefs shufflefs rw\n"
        "33 29 8:16 / /scratch rw master:5 - xfs /dev/sdb rw\n"
        "a line it cannot parse\n"
    )
    assert local_devices(str(mountinfo)) == {
        os.makedev(254, 0),
        os.makedev(0, 23),
        os.makedev(8, 16),
    }
    assert local_devices(str(tmp_path / "none")) == frozenset()  # (all to the thread)
    here = mount_of(tmp_path)
    if here is not None and here.fstype in LOCAL_FSTYPES:  # this machine's own table
        assert os.stat(tmp_path).st_dev in local_devices()


async def test_the_byte_budget_never_lends_more_than_its_limit() -> None:
    """Files in flight hold their bytes from a `ByteBudget`: never more than
    its limit at once, a request bigger than the limit granted the whole of
    it alone, and every waiter served once bytes come back."""
    budget = ByteBudget(100)
    peak = 0
    order: list[int] = []

    async def hold(n: int, seconds: float) -> None:
        nonlocal peak
        got = await budget.acquire(n)
        peak = max(peak, budget.held)
        order.append(n)
        await trio.sleep(seconds)
        budget.release(got)

    async with trio.open_nursery() as nursery:
        for n in (60, 30, 50, 500, 10):
            nursery.start_soon(hold, n, 0.05)
            await trio.sleep(0)
    assert peak <= 100
    assert sorted(order) == [10, 30, 50, 60, 500]
    assert budget.held == 0
