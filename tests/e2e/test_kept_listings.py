"""Whole listings kept by ``-o ro`` and ``cache=immutable`` mounts
(fuse/kept_listings.py), with real mounts of one cluster: once a directory
was listed, listing it again after the kernel dropped its caches makes no
metadata call and gives exactly the names, inodes and attributes there are,
across pages of the server's listing and the kernel's READDIRPLUS replies;
a change made on another mount shows within the mode's timeouts (read-write
mounts keep names only, while the cache watch keeps the directory: a change
anywhere shows at the next listing); ``keep_listings=0`` turns it off."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, wait_until
from opsworld import MeteredMount, metered_mounts

from shufflefs.fuse.dir_handles import READDIR_PAGE

# they drop the kernel's caches: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

FAMILY = "shufflefs_client_fast_answers"
FILES = READDIR_PAGE + 44  # two pages of the server's listing, many READDIRPLUS replies
BOUND = 2.0  # the short ro mount's timeouts
SLACK = 10.0  # what the test allows beyond the bound on a busy machine
LISTING_CALLS = ("readdir", "watch_dir", "readdir_layouts")


@pytest.fixture(scope="module")
def mounts(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, MeteredMount]]:
    """R (-o ro), I (cache=immutable), S (-o ro, BOUND-second timeouts),
    N (-o ro,keep_listings=0), W (read-write, names only): each a mount of
    its own."""
    options = {
        "W": "",
        "R": "ro",
        "I": "cache=immutable",
        "S": f"ro,attr_timeout={BOUND},entry_timeout={BOUND}",
        "N": "ro,keep_listings=0",
    }
    with metered_mounts(mounted, tmp_path_factory, "kept", options, FAMILY, "op") as mounts:
        yield mounts


@pytest.fixture
def tree(mnt: Path) -> Path:
    """FILES files of different sizes and a subdirectory in the test's
    directory (written through the session's mount)."""
    for i in range(FILES):
        (mnt / f"sample-{i:05d}.bin").write_bytes(b"z" * i)
    (mnt / "sub").mkdir()
    (mnt / "sub" / "inner").write_bytes(b"inner")
    return mnt


def listing(d: Path) -> dict[str, tuple[int, int, int, int, int]]:
    """name -> (inode, mode, size, mtime, nlink) as a listing and a stat show them."""
    out = {}
    with os.scandir(d) as it:
        for e in it:
            st = e.stat(follow_symlinks=False)
            assert e.inode() == st.st_ino
            out[e.name] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_nlink)
    return out


def drop_kernel_entries() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def listing_calls(cluster: ProcessCluster) -> dict[str, int]:
    calls = cluster.meta_calls()
    return {k: calls.get(k, 0) for k in LISTING_CALLS}


@pytest.mark.parametrize("mode", ["R", "I"])
def test_a_directory_listed_again_after_a_drop_of_the_caches_asks_nothing(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path, mode: str
) -> None:
    m = mounts[mode]
    d = m.mountpoint / tree.name
    first = listing(d)
    assert len(first) == FILES + 1
    assert first[f"sample-{FILES - 1:05d}.bin"][2] == FILES - 1
    for _ in range(2):
        drop_kernel_entries()
        answered, before = m.count("listing"), listing_calls(mounted)
        assert listing(d) == first
        assert listing_calls(mounted) == before
        assert m.count("listing") > answered
    # and what it told the kernel serves: names resolve, bytes read, a subdirectory lists
    assert (d / "sample-00123.bin").read_bytes() == b"z" * 123
    assert os.listdir(d / "sub") == ["inner"]
    assert (d / "sub" / "inner").read_bytes() == b"inner"


GETDENTS64 = {"x86_64": 217, "aarch64": 61}


def small_getdents(d: Path, size: int) -> list[str]:
    """The names of *d* read with getdents64 into a *size*-byte buffer (a few
    entries a call, where the kernel's READDIRPLUS asks for a page)."""
    libc = ctypes.CDLL(None, use_errno=True)
    number = GETDENTS64.get(os.uname().machine)
    if number is None:
        pytest.skip("getdents64's number on this machine is not known here")
    buf = ctypes.create_string_buffer(size)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    names = []
    try:
        while True:
            n = libc.syscall(number, fd, buf, size)
            if n < 0:
                raise OSError(ctypes.get_errno(), "getdents64")
            if n == 0:
                return names
            at = 0
            while at < n:
                reclen = struct.unpack_from("<H", buf.raw, at + 16)[0]
                names.append(buf.raw[at + 19 : at + reclen].split(b"\0", 1)[0].decode())
                at += reclen
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["R", "I"])
def test_listings_resume_where_the_kernel_stands_with_a_small_buffer(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path, mode: str
) -> None:
    """A reader whose buffer holds a few entries takes a reply's first ones;
    the kernel resumes at the offset of the last it took, inside a reply."""
    m = mounts[mode]
    d = m.mountpoint / tree.name
    names = sorted(os.listdir(d))
    for size in (300, 1000):
        drop_kernel_entries()
        answered, before = m.count("listing"), listing_calls(mounted)
        got = small_getdents(d, size)
        assert sorted(got) == sorted([".", "..", *names])
        assert len(got) == len(names) + 2  # each once
        assert listing_calls(mounted) == before
        assert m.count("listing") > answered
    # every name still resolves to its own file
    assert (d / "sample-00255.bin").stat().st_size == 255


def test_a_change_on_another_mount_shows_within_the_timeouts(
    mounts: dict[str, MeteredMount], tree: Path
) -> None:
    s = mounts["S"]
    d = s.mountpoint / tree.name
    before = listing(d)
    (tree / "new-one").write_bytes(b"new")
    (tree / "sample-00007.bin").unlink()

    def changed() -> bool:
        drop_kernel_entries()
        now = listing(d)
        return "new-one" in now and "sample-00007.bin" not in now

    wait_until("the change listed", changed, timeout=BOUND + SLACK)
    assert set(listing(d)) == set(before) - {"sample-00007.bin"} | {"new-one"}


def test_keep_listings_0_keeps_none(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path
) -> None:
    m = mounts["N"]
    d = m.mountpoint / tree.name
    first = listing(d)
    drop_kernel_entries()
    before = listing_calls(mounted)
    assert listing(d) == first
    assert listing_calls(mounted)["readdir"] > before["readdir"]
    assert m.count("listing") == 0


def names(d: Path) -> dict[str, tuple[int, bool]]:
    """name -> (inode, is a directory) as a listing alone shows them."""
    with os.scandir(d) as it:
        return {e.name: (e.inode(), e.is_dir(follow_symlinks=False)) for e in it}


def test_a_read_write_mount_keeps_names_while_its_watch_keeps_the_directory(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path
) -> None:
    w = mounts["W"]
    d = w.mountpoint / tree.name
    first = listing(d)
    listed = names(d)
    assert len(listed) == FILES + 1 and listed["sub"][1]
    drop_kernel_entries()
    answered, before = w.count("listing"), listing_calls(mounted)
    assert names(d) == listed
    assert listing_calls(mounted) == before
    assert w.count("listing") > answered
    # a stat then looks each name up, and finds what there is
    assert listing(d) == first
    # a change on another mount: the next listing has it, at once
    (tree / "made-elsewhere").write_bytes(b"e")
    (tree / "sample-00003.bin").unlink()
    now = names(d)
    assert "made-elsewhere" in now and "sample-00003.bin" not in now
    # and one made on this mount
    drop_kernel_entries()
    names(d)  # (kept again, at the new change counter)
    (d / "made-here").write_bytes(b"h")
    drop_kernel_entries()
    assert "made-here" in names(d)
    assert set(names(d)) == set(listed) - {"sample-00003.bin"} | {"made-elsewhere", "made-here"}


def test_a_read_write_mounts_first_listing_brings_every_entrys_attributes(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path
) -> None:
    """The first listing of a directory on a read-write mount hands the kernel
    its entries with their attributes, so an ``ls -l`` right after it looks
    few names up: the kernel asks for the user's buffer's worth (32 KiB for
    glibc, about 190 entries) a READDIRPLUS, the first goes through pyfuse3
    with attributes, a later one may come from the listing kept meanwhile
    (names only on this mode), and the first LOOKUP of one of those names
    opens the directory's files ahead (`dir_ahead`), which answers the rest."""
    w = mounts["W"]
    for n in (READDIR_PAGE - 56, FILES):  # one page of the server's listing, and two
        (tree / f"d{n}").mkdir()
        for i in range(n):
            (tree / f"d{n}" / f"f{i:04d}").write_bytes(b"y" * i)
        d = w.mountpoint / tree.name / f"d{n}"
        before = mounted.meta_calls()
        first = listing(d)  # scandir, then a stat of each entry
        after = mounted.meta_calls()
        looked_up = sum(after.get(k, 0) - before.get(k, 0) for k in ("lookup", "lookup_open"))
        # (each of the mode's 1-second timeouts would have to expire
        # mid-listing for a stat to look its name up)
        assert looked_up < n // 4, (n, looked_up)
        assert len(first) == n and first["f0099"][2] == 99


@pytest.mark.parametrize("mode", ["R", "W"])
def test_opendir_and_releasedir_of_a_known_directory_are_answered_in_the_callback(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], tree: Path, mode: str
) -> None:
    """``ro`` knows a looked-up directory's parent, a read-write mount while
    its cache watch keeps the directory: the OPENDIR needs no round trip and
    is answered with the RELEASEDIR in libfuse's callback (the first few
    RELEASEDIRs go through pyfuse3, which confirms where libfuse keeps the
    handle), and the listings they frame are whole."""
    m = mounts[mode]
    d = m.mountpoint / tree.name
    expected = sorted(os.listdir(d))
    opened, released = m.count("opendir"), m.count("releasedir")
    for _ in range(3):
        drop_kernel_entries()
        assert sorted(os.listdir(d)) == expected
        assert sorted(os.listdir(d / "sub")) == ["inner"]
    assert m.count("opendir") > opened and m.count("releasedir") > released
    # a directory the mount does not know yet is opened the usual way
    (tree / "fresh").mkdir()
    (tree / "fresh" / "one").write_bytes(b"1")
    assert os.listdir(d / "fresh") == ["one"]
