"""Prefetch along the shuffle through the mount (fuse/prefetch.py).

A second mount of the shared cluster with reads through the storage daemons
only (``no_local_reads``) and a small budget takes hints by xattr. Hinted
files are then read with every storage daemon stopped (SIGSTOP): nothing
reaches storage; hinted again, once the kernel holds them, they are not
fetched at all, also after the kernel lost a page of one, but they are once
it dropped them all. A huge hint stream keeps the cache under its budget;
a change on the other mount, or a write, truncate or unlink through this
one, drops the cached bytes; bad hints get their errno and change nothing.

A third mount in the dataset mode (``cache=immutable``, read-only) takes
hints by name (paths in getxattr names of its root) and then answers the
lookups and reads of the hinted files with the storage daemons and the
metadata server stopped; `MountHints` hints it that way. Files the kernel
already knows (their directory listed) go into its page cache as they are
fetched (fuse/page_store.py): their reads never reach the mount, and
close-to-open still holds for them.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clusters import (
    ProcessCluster,
    chain_places,
    chunk_files,
    mount_metrics_url,
    mount_pid,
    storage_stopped,
)
from harness import flip, shufflefs
from opsworld import total
from procfs import open_files

# they drop the kernel's caches, or count what those spare: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

XATTR = "user.shufflefs.prefetch"
BUDGET = 4 << 20
SIZE = 110_000


def extra_mount(
    cluster: ProcessCluster, factory: pytest.TempPathFactory, name: str, options: str
) -> Iterator[Path]:
    """Another mount of the shared cluster with *options*, for a module."""
    mountpoint = factory.mktemp(name)
    shufflefs("mount", "--config", str(cluster.client_config), "-o", options, str(mountpoint))
    try:
        yield mountpoint
    finally:
        shufflefs("umount", str(mountpoint))


@pytest.fixture(scope="module")
def pmnt(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from extra_mount(
        mounted, tmp_path_factory, "prefetch-mount", f"no_local_reads,prefetch_memory={BUDGET}"
    )


def status(root: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(os.getxattr(root, XATTR))
    return state


def hint(root: Path, paths: list[str]) -> None:
    os.setxattr(root, XATTR, "\n".join(paths).encode())


def taken(s: dict[str, Any]) -> int:
    """Hinted ranges read ahead: kept by the mount, or stored in the
    kernel's page cache (a file the kernel knows: fuse/page_store.py)."""
    return int(s["fetched"] + s["stored"])


def wait_status(
    root: Path, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0
) -> dict[str, Any]:
    """The mount's prefetch state once *done* holds of it (polled: the
    state has no change notification), failing after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not done(s := status(root)):
        assert time.monotonic() < deadline, f"{what}, not in {timeout} s: {s}"
        time.sleep(0.02)
    return s


def wait_fetched(root: Path, count: int, timeout: float = 30.0) -> dict[str, Any]:
    return wait_status(
        root, lambda s: taken(s) >= count and s["pending"] == 0, f"{count} fetched", timeout
    )


def write_files(d: Path, n: int, tag: bytes = b"") -> list[bytes]:
    out = []
    for i in range(n):
        data = (tag + os.urandom(SIZE))[:SIZE]
        (d / f"f{i}").write_bytes(data)
        out.append(data)
    return out


def process_state(pid: int | None) -> str:
    """The state letter of /proc/PID/stat (T: stopped)."""
    assert pid is not None
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return stat_line.rsplit(")", 1)[1].split()[0]


READER = "import sys; [sys.stdout.buffer.write(open(p, 'rb').read()) for p in sys.argv[1:]]"


def read_in_child(paths: list[Path], timeout: float) -> bytes | None:
    """The files' bytes read by another process, or None if it did not finish
    in *timeout* seconds (then it is killed)."""
    child = subprocess.Popen(
        [sys.executable, "-c", READER, *map(str, paths)], stdout=subprocess.PIPE
    )
    try:
        out, _ = child.communicate(timeout=timeout)
        assert child.returncode == 0
        return out
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None


@contextmanager
def pinned(paths: list[Path], skip: int = 0) -> Iterator[None]:
    """The files' pages kept in the kernel's page cache (mlock through a
    mapping; the first *skip* bytes, page-aligned, of the first file left
    free, so they can be dropped). These VMs page out cold memory
    proactively (DAMON), page cache too: a page read a moment ago may be
    gone, and its READ would reach the mount as one the test did not cause."""
    libc = ctypes.CDLL(None, use_errno=True)
    held: list[tuple[mmap.mmap, int]] = []
    try:
        for i, path in enumerate(paths):
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            start = skip if i == 0 else 0
            held.append((m, start))
            at = ctypes.c_void_p(_address(m) + start)
            if libc.mlock(at, ctypes.c_size_t(len(m) - start)):
                raise OSError(ctypes.get_errno(), f"mlock of {path}")
        yield
    finally:
        for m, start in held:
            libc.munlock(ctypes.c_void_p(_address(m) + start), ctypes.c_size_t(len(m) - start))
            m.close()


def _address(m: mmap.mmap) -> int:
    """Where a read-only mapping starts (ctypes takes writable buffers only)."""
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


def drop_pages(path: Path, length: int) -> None:
    """The kernel drops the first *length* bytes of *path* from its page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def dmnt(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The dataset mode: read-only, cache=immutable, reads through the daemons."""
    options = f"cache=immutable,no_local_reads,prefetch_memory={BUDGET}"
    yield from extra_mount(mounted, tmp_path_factory, "dataset-mount", options)


def test_hinted_files_are_read_without_reaching_storage(
    mounted: ProcessCluster, mnt: Path, pmnt: Path
) -> None:
    data = write_files(mnt, 12)
    before = status(pmnt)
    hint(pmnt, [f"{mnt.name}/f{i}" for i in range(10)])  # f10, f11 not hinted
    wait_fetched(pmnt, taken(before) + 10)
    here = pmnt / mnt.name
    with storage_stopped(mounted):
        got = read_in_child([here / f"f{i}" for i in range(10)], timeout=20)
        assert got == b"".join(data[:10])
        # the control: an unhinted file cannot be read while storage is stopped
        assert read_in_child([here / "f10"], timeout=1.5) is None
    after = status(pmnt)
    assert after["hits"] >= before["hits"] + 10
    assert after["served_bytes"] - before["served_bytes"] == 10 * SIZE
    assert (here / "f11").read_bytes() == data[11]
    warm = [here / f"f{i}" for i in (*range(10), 11)]
    with pinned(warm, skip=4096):  # (f0's first page left free: dropped below)
        # read through this mount, the files are in the kernel's page cache:
        # hints for them again (a warm epoch) fetch nothing
        hint(pmnt, [f"{mnt.name}/f{i}" for i in (*range(10), 11)])
        again = wait_fetched(pmnt, taken(after))
        assert again["resident"] == after["resident"] + 11, again
        assert taken(again) == taken(after)

        # the kernel loses a page of f0: that one read reaches the mount, which
        # goes on skipping (the odd page, not a kernel evicting whole files)
        drop_pages(here / "f0", 4096)
        hint(pmnt, [f"{mnt.name}/{p.name}" for p in warm])
        wait_fetched(pmnt, taken(again))
        assert read_in_child(warm, timeout=20) == b"".join(data[:10]) + data[11]
        later = status(pmnt)
        assert later["evicted"] == again["evicted"] + 1, later
        assert taken(later) == taken(again), later
    # every page dropped: once most reads of skipped files reached the mount
    # (one in two of the skipped files it knows the fate of, here the ten
    # closes above among them), it stops skipping: the same files hinted
    # again, read whole just now, are fetched (fuse/prefetch_resident.py;
    # which files not read yet it fetches at that moment races the reader)
    for p in warm:
        drop_pages(p, SIZE)
    hint(pmnt, [f"{mnt.name}/{p.name}" for p in warm])
    wait_fetched(pmnt, taken(later))
    assert read_in_child(warm, timeout=20) == b"".join(data[:10]) + data[11]
    final = status(pmnt)
    assert final["evicted"] > later["evicted"], final
    hint(pmnt, [f"{mnt.name}/{p.name}" for p in warm])
    fetched = wait_fetched(pmnt, taken(final) + len(warm))
    assert fetched["resident"] == final["resident"], fetched


def test_a_read_that_catches_up_with_the_prefetch_waits_for_its_bytes(
    mounted: ProcessCluster, mnt: Path, pmnt: Path
) -> None:
    """A READ of a file whose prefetch read is under way waits for it and
    is answered from its bytes (fuse/prefetch_landing.py), rather than
    reading them a second time: with storage stopped, the hinted file's
    read waits; once storage goes on, both end, with the right bytes."""
    d = mnt / "landing"
    d.mkdir()
    (data,) = write_files(d, 1)
    here = pmnt / mnt.name / "landing" / "f0"
    assert here.stat().st_size == SIZE  # looked up (no storage needed)
    before = status(pmnt)
    with storage_stopped(mounted):
        hint(pmnt, [f"{mnt.name}/landing/f0"])
        reader = subprocess.Popen([sys.executable, "-c", READER, str(here)], stdout=subprocess.PIPE)
        wait_status(pmnt, lambda s: s["waited"] > before["waited"], "the READ waits", 10)
        assert reader.poll() is None
    out, _ = reader.communicate(timeout=30)
    assert reader.returncode == 0 and out == data
    after = status(pmnt)
    assert after["waited"] == before["waited"] + 1
    assert after["hits"] > before["hits"], after  # answered from the prefetch read's bytes


def test_a_hinted_file_read_before_its_turn_is_not_fetched(mnt: Path, pmnt: Path) -> None:
    """The reader got to a hinted file first (the prefetcher fell behind):
    when its hint's turn comes it is dropped unread (``late``)."""
    d = mnt / "late"
    d.mkdir()
    write_files(d, 120)  # 13 MB: three times what the 4 MiB budget holds
    (d / "b").write_bytes(b"b" * 5000)
    here = pmnt / mnt.name / "late"
    before = status(pmnt)
    hint(pmnt, [f"{mnt.name}/late/f{i}" for i in range(40)])
    wait_status(pmnt, lambda s: s["held_bytes"] >= BUDGET // 2 and not s["pending"], "full", 20)
    # the budget is full: every fetcher waits for room with what it took
    hint(pmnt, [f"{mnt.name}/late/f{i}" for i in range(40, 120)] + [f"{mnt.name}/late/b"])
    assert status(pmnt)["pending"] >= 1
    assert (here / "b").read_bytes() == b"b" * 5000  # before its turn
    for i in range(120):  # read (the held ones dropped: room for the rest)
        (here / f"f{i}").read_bytes()
    s = wait_status(
        pmnt,
        lambda s: taken(s) - taken(before) + s["late"] - before["late"] >= 121,
        "every hint taken or late",
    )
    assert s["late"] > before["late"] and s["pending"] == 0, s


def test_memory_stays_under_the_budget_with_a_huge_hint_stream(mnt: Path, pmnt: Path) -> None:
    n = 100  # 11 MB of files, a 4 MiB budget
    data = write_files(mnt, n)
    paths = [f"{mnt.name}/f{i}" for i in range(n)]
    peak = 0
    batch = 60_000 // len(paths[0])  # under the kernel's 64 KiB per xattr value
    for _ in range(70_000 // batch + 1):  # over MAX_PENDING (65,536) hinted ranges
        hint(pmnt, (paths * (batch // n + 1))[:batch])
        s = status(pmnt)
        peak = max(peak, s["held_bytes"])
        assert s["held_bytes"] <= BUDGET and s["pending"] <= 65536
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = status(pmnt)
        peak = max(peak, s["held_bytes"])
        assert s["held_bytes"] <= BUDGET
        if s["held_bytes"] > BUDGET // 2:
            break
        time.sleep(0.05)
    assert s["dropped"] > 0  # the oldest hints were pushed out, not kept
    assert BUDGET // 2 < peak <= BUDGET  # it filled the budget (reads are batched), no more
    # every file still reads right, from the cache or not
    for i in range(n):
        assert (pmnt / mnt.name / f"f{i}").read_bytes() == data[i]
    os.setxattr(pmnt, XATTR, b"")  # an empty hint cancels the queue, drops what is held
    deadline = time.monotonic() + 10  # reads in flight finish, and are not kept
    while (s := status(pmnt))["held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["pending"] == 0 and s["entries"] == 0 and s["held_bytes"] == 0


def test_cached_bytes_are_dropped_when_the_file_changes(mnt: Path, pmnt: Path) -> None:
    write_files(mnt, 4, b"old")
    here = pmnt / mnt.name
    base = status(pmnt)
    hint(pmnt, [f"{mnt.name}/f{i}" for i in range(4)])
    wait_fetched(pmnt, taken(base) + 4)
    # another mount writes (same size) and closes: the next open here sees it
    new0 = b"new" + os.urandom(SIZE - 3)
    (mnt / "f0").write_bytes(new0)
    assert (here / "f0").read_bytes() == new0
    # a write through this mount
    with open(here / "f1", "r+b") as f:
        f.write(b"W")
    assert (mnt / "f1").read_bytes()[:1] == b"W"
    assert (here / "f1").read_bytes()[:1] == b"W"
    # a truncate through this mount
    os.truncate(here / "f2", 10)
    assert (here / "f2").read_bytes() == (mnt / "f2").read_bytes()[:10]
    assert len((mnt / "f2").read_bytes()) == 10
    s = status(pmnt)
    assert s["invalidated"] >= base["invalidated"] + 3
    # an unlink through this mount drops the entry of that name
    held = s["held_bytes"]
    os.unlink(here / "f3")
    assert status(pmnt)["held_bytes"] == held - SIZE


def test_bad_hints_get_an_error_and_change_nothing(mnt: Path, pmnt: Path) -> None:
    write_files(mnt, 2)
    (mnt / "sub").mkdir()
    os.setxattr(pmnt, XATTR, b"")
    before = status(pmnt)
    good = f"{mnt.name}/f0"
    bad: list[tuple[bytes, int]] = [
        (f"{good}\n{mnt.name}/missing".encode(), errno.ENOENT),  # one good, one missing
        (f"{good}\nno-such-dir/f0".encode(), errno.ENOENT),
        (b'["' + good.encode() + b'", 3', errno.EINVAL),  # malformed JSON
        (json.dumps([[good, -1, 10]]).encode(), errno.EINVAL),
        (json.dumps([{"path": good}]).encode(), errno.EINVAL),
        (json.dumps([[good, 0, BUDGET + 1]]).encode(), errno.E2BIG),
        ("\n".join(["f"] * 8193).encode(), errno.E2BIG),  # too many items
        (b"f" * (65 << 10), errno.E2BIG),  # over the kernel's XATTR_SIZE_MAX
        (f"{good}\n{mnt.name}/sub".encode(), errno.EISDIR),
        (f"{mnt.name}/f0/x".encode(), errno.ENOTDIR),
    ]
    for value, code in bad:
        with pytest.raises(OSError) as info:
            os.setxattr(pmnt, XATTR, value)
        assert info.value.errno == code, value[:60]
    with pytest.raises(OSError) as info:  # batches go to the mount root only
        os.setxattr(pmnt / mnt.name, XATTR, good.encode())
    assert info.value.errno == errno.EINVAL
    after = status(pmnt)
    for key in ("hinted", "pending", "fetched", "entries", "held_bytes"):
        assert after[key] == before[key], key
    # the mount still works, and a good hint is taken
    os.setxattr(pmnt, XATTR, json.dumps([[good, 0, 1000]]).encode())
    assert status(pmnt)["hinted"] == before["hinted"] + 1


def test_a_dataset_mount_reads_hinted_files_with_no_server_at_all(
    mounted: ProcessCluster, mnt: Path, dmnt: Path
) -> None:
    """Hints by name on the read-only mount (the kernel refuses setxattr
    there): nothing of the files is looked up by the kernel before, and
    then their lookups and reads are answered with every storage daemon and
    the metadata server stopped."""
    d = mnt / "named"
    d.mkdir()
    data = write_files(d, 12)
    here = dmnt / mnt.name / "named"
    os.stat(here)  # the directory is known to the kernel; its files are not
    before = status(dmnt)
    rel = [f"{mnt.name}/named/f{i}" for i in range(10)]
    with pytest.raises(OSError) as info:
        hint(dmnt, rel)
    assert info.value.errno == errno.EROFS
    parts = [rel[k : k + 2] for k in range(0, 10, 2)]  # paths in the xattr's name (255 bytes)
    for part in parts:
        assert os.getxattr(dmnt, XATTR + "/" + "\n".join(part)) == b"queued"
    wait_fetched(dmnt, taken(before) + 10)
    with storage_stopped(mounted, "meta"):
        got = read_in_child([here / f"f{i}" for i in range(10)], timeout=20)
        assert got == b"".join(data[:10])
        # the control: they are stopped (a read of an unhinted file would
        # wait for the metadata server's timeout, in the kernel, unkillably)
        for name in mounted.names():
            if name.startswith(("storage", "meta")):
                assert process_state(mounted.pid(name)) == "T", name
    after = status(dmnt)
    assert after["hits"] >= before["hits"] + 10
    assert (here / "f11").read_bytes() == data[11]


def test_named_hints_get_an_error_and_change_nothing(mnt: Path, dmnt: Path) -> None:
    write_files(mnt, 1)
    (mnt / "subdir").mkdir(exist_ok=True)
    before = status(dmnt)
    good = f"{mnt.name}/f0"
    bad: list[tuple[Path, str, int]] = [
        (dmnt, f"{good}\n{mnt.name}/missing", errno.ENOENT),
        (dmnt, f"{mnt.name}/subdir", errno.EISDIR),
        (dmnt, f"{mnt.name}/f0/x", errno.ENOTDIR),
        (dmnt, "", errno.EINVAL),  # no path
        (dmnt / mnt.name, "f0", errno.EINVAL),  # asked of another directory
    ]
    for where, paths, code in bad:
        with pytest.raises(OSError) as info:
            os.getxattr(where, XATTR + "/" + paths)
        assert info.value.errno == code, paths
    after = status(dmnt)
    for key in ("hinted", "pending", "fetched"):
        assert after[key] == before[key], key


def test_named_hints_are_taken_in_libfuses_callback(
    mounted: ProcessCluster, mnt: Path, dmnt: Path
) -> None:
    """A getxattr carrying hints is taken before pyfuse3 sees it (a task of
    its own queues them, then answers: fuse/fast_hints.py), with the value
    and errnos it always had; a size probe (size 0) goes the usual way."""
    d = mnt / "fasthints"
    d.mkdir()
    write_files(d, 3)
    url = mount_metrics_url(mounted, dmnt)
    before = total(url, "shufflefs_client_fast_answers", op="hint")
    state = status(dmnt)
    assert os.getxattr(dmnt, f"{XATTR}/{mnt.name}/fasthints/f0") == b"queued"
    with pytest.raises(OSError) as info:
        os.getxattr(dmnt, f"{XATTR}/{mnt.name}/fasthints/missing")
    assert info.value.errno == errno.ENOENT
    libc = ctypes.CDLL(None, use_errno=True)
    name = f"{XATTR}/{mnt.name}/fasthints/f1".encode()
    assert libc.getxattr(bytes(dmnt), name, None, 0) == len(b"queued")
    assert total(url, "shufflefs_client_fast_answers", op="hint") == before + 2
    s = wait_fetched(dmnt, taken(state) + 2)
    assert s["hinted"] == state["hinted"] + 2, s
    for i in range(2):  # read: the mount holds nothing of them any more
        assert (dmnt / mnt.name / "fasthints" / f"f{i}").stat().st_size == SIZE
        assert read_in_child([dmnt / mnt.name / "fasthints" / f"f{i}"], timeout=20)
    wait_status(dmnt, lambda s: s["held_bytes"] == state["held_bytes"], "read", 10)


def test_a_loader_hints_a_read_only_mount_by_name(mnt: Path, dmnt: Path) -> None:
    """`MountHints` (what the datasets of shufflefs.client.data use) sends
    paths in getxattr names where setxattr is refused; a path too long for
    a name goes by a getxattr on the file."""
    from shufflefs.client.data.mount_hints import MountHints

    d = mnt / "loader"
    d.mkdir()
    long_name = "L" * 240  # with the prefix, over XATTR_NAME_MAX
    (d / long_name).write_bytes(b"x" * 5000)
    data = write_files(d, 6)
    here = dmnt / mnt.name / "loader"
    paths = [str(here / f"f{i}") for i in range(6)] + [str(here / long_name)]
    before = status(dmnt)
    hints = MountHints.find(paths, whole_files=True)
    assert hints is not None
    hints.files(range(len(paths)))
    hints.flush()
    assert hints.read_only and hints.named
    s = wait_fetched(dmnt, taken(before) + 7)
    assert s["failed"] == before["failed"]
    hints.close()
    for i in range(6):
        assert (here / f"f{i}").read_bytes() == data[i]
    assert (here / long_name).read_bytes() == b"x" * 5000
    after = status(dmnt)
    # it listed the directory first: the kernel knew every file, so their
    # bytes went into its page cache and no read reached the mount
    assert after["stored"] == before["stored"] + 7, after
    assert after["hits"] == before["hits"], after


def test_stored_pages_answer_reads_with_no_server_and_no_round_trip(
    mounted: ProcessCluster, mnt: Path, dmnt: Path
) -> None:
    """Files the kernel knows (their directory listed) are stored in its
    page cache as they are fetched: then read with the storage daemons and
    the metadata server stopped, and no read reaches the mount."""
    d = mnt / "stored"
    d.mkdir()
    data = write_files(d, 8)
    here = dmnt / mnt.name / "stored"
    assert sorted(os.listdir(here)) == sorted(f"f{i}" for i in range(8))
    before = status(dmnt)
    for k in range(0, 8, 2):  # (two paths fit in the xattr's name: 255 bytes)
        names = "\n".join(f"{mnt.name}/stored/f{i}" for i in range(k, k + 2))
        assert os.getxattr(dmnt, XATTR + "/" + names) == b"queued"
    s = wait_fetched(dmnt, taken(before) + 8)
    assert s["stored"] == before["stored"] + 8 and s["fetched"] == before["fetched"], s
    assert s["held_bytes"] == 0  # the kernel holds them, not the mount
    # (pinned: a stored page the VM's proactive reclaim took would send a READ
    # to the stopped servers, as in `pinned`'s other users: failed 1 CI run)
    with pinned([here / f"f{i}" for i in range(8)]), storage_stopped(mounted, "meta"):
        got = read_in_child([here / f"f{i}" for i in range(8)], timeout=20)
        assert got == b"".join(data)
    after = status(dmnt)
    assert after["hits"] == before["hits"], after
    # hinted again (the next epoch): the kernel holds them, nothing is read,
    # and the mount says so (a loader then sends fewer: client/data/mount_hints.py)
    assert os.getxattr(dmnt, XATTR + "/" + f"{mnt.name}/stored/f0") == b"held"
    again = wait_fetched(dmnt, taken(after))
    assert again["resident"] == after["resident"] + 1 and taken(again) == taken(after)


def test_stored_pages_of_a_changed_file_are_not_read(mnt: Path, pmnt: Path) -> None:
    """Close-to-open holds for bytes stored in the kernel: another mount's
    change (then an open here) and a write here are read, not the stored bytes."""
    d = mnt / "changing"
    d.mkdir()
    write_files(d, 2, b"old")
    here = pmnt / mnt.name / "changing"
    os.listdir(here)  # the kernel knows them
    before = status(pmnt)
    hint(pmnt, [f"{mnt.name}/changing/f{i}" for i in range(2)])
    s = wait_fetched(pmnt, taken(before) + 2)
    assert s["stored"] == before["stored"] + 2, s
    new0 = b"new" + os.urandom(SIZE - 3)
    (d / "f0").write_bytes(new0)  # through the other mount, closed
    assert (here / "f0").read_bytes() == new0
    with open(here / "f1", "r+b") as f:
        f.write(b"W")
    assert (here / "f1").read_bytes()[:1] == b"W"
    assert (d / "f1").read_bytes()[:1] == b"W"


@pytest.fixture(scope="module")
def lmnt(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The dataset mode on a host with a replica of every chain (this
    one-host cluster): the mount reads the chunk files itself."""
    options = f"cache=immutable,prefetch_memory={BUDGET}"
    yield from extra_mount(mounted, tmp_path_factory, "local-dataset-mount", options)


def test_a_cold_prefetch_reads_the_chunk_files_here_and_never_a_damaged_block(
    mounted: ProcessCluster, mnt: Path, lmnt: Path
) -> None:
    """A prefetch expects cold bytes (`FileSystem.read_into(cold=True)`):
    the chunk files on this host are opened and read through the loop's
    io_uring, all at once (or, without io_uring, in a worker thread that
    starts every file's readahead before it waits for the first), not tried
    on the event loop first. The bytes are exact, read from the chunk files here
    (the mount holds them open), and a damaged block of the replica read
    here is never what a reader gets: another replica's bytes are."""
    from shufflefs.client.data.mount_hints import MountHints

    d = mnt / "coldlocal"
    d.mkdir()
    data = write_files(d, 8)
    damaged = set()
    for i in range(4):  # the head replica of f0..f3, which a reader here reads
        chunks = chunk_files(mounted.data_dir, (d / f"f{i}").stat().st_ino)
        for f, place in chain_places(mounted, f"/{mnt.name}/coldlocal/f{i}", chunks).items():
            if place == 0:
                flip(f, 70_000)
                damaged.add(f.name)
    assert len(damaged) == 4
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    here = lmnt / mnt.name / "coldlocal"
    paths = [str(here / f"f{i}") for i in range(8)]
    before = status(lmnt)
    hints = MountHints.find(paths, whole_files=True)
    assert hints is not None
    hints.files(range(8))
    hints.flush()
    s = wait_fetched(lmnt, taken(before) + 8)
    assert s["failed"] == before["failed"], s
    hints.close()
    held = {os.path.basename(t) for t in open_files(mount_pid(mounted, lmnt)) if "/chunks/" in t}
    for i in range(8):
        assert (here / f"f{i}").read_bytes() == data[i], i
    # every undamaged file read from its chunk files here (a damaged one's
    # piece went to the daemons, or to another replica here: which one the
    # replica choice took, by load, is not this test's)
    inos = {f"{(d / f'f{i}').stat().st_ino:016x}" for i in range(4, 8)}
    assert inos <= {name[:16] for name in held}
