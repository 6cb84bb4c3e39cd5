"""The consistency model of each mount mode, with real mounts of one cluster
(docs/operations.md, "Mount modes and caches"):

* default (read-write): close-to-open between two mounts, and a cached open
  of an unchanged file makes no `open` call on the metadata server;
* ``-o ro``: every mutation is EROFS; an open of a file opened before makes
  no metadata call at all; a change made elsewhere is seen within the
  mount's timeouts (here 1 s);
* ``-o cache=immutable``: as ``ro``, and the kernel serves warm opens, reads
  and closes with no request to the mount at all (it answers OPEN with
  ENOSYS; READs name their inode, fuse/read_inode.py): checked with the
  mount process stopped;
* `shufflefs status` lists every mount with its mode and timeouts.

The metadata server's own request counts (`rpc_calls`) say what an open cost.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from clusters import ProcessCluster, wait_until
from harness import read_whole as read
from harness import rewrite_in_place, shufflefs

# they drop the kernel's caches, or count what those spare: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

BOUND = 1.0  # the short ro mount's attr/entry/negative timeout
SLACK = 10.0  # what the test allows beyond the bound on a busy machine


@pytest.fixture(scope="module")
def mounts(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    """A (the session's default mount), B (another default mount), L (the
    same, no listings read ahead), R (-o ro, default timeouts), S (-o ro with
    BOUND-second timeouts), I and J (the same two with cache=immutable)."""
    made: list[Path] = []
    short = f"attr_timeout={BOUND},entry_timeout={BOUND},negative_timeout={BOUND}"
    options = {
        "B": [],
        "L": ["-o", "list_ahead=0"],
        "R": ["-o", "ro"],
        "S": ["-o", f"ro,{short}"],
        "I": ["-o", "cache=immutable"],
        "J": ["-o", f"cache=immutable,{short}"],
    }
    try:
        for name, opts in options.items():
            mountpoint = tmp_path_factory.mktemp(f"mount-{name}")
            shufflefs("mount", "--config", str(mounted.client_config), *opts, str(mountpoint))
            made.append(mountpoint)
        yield {"A": mounted.mountpoint, **dict(zip(options, made, strict=True))}
    finally:
        for mountpoint in made:
            shufflefs("umount", str(mountpoint))


@pytest.fixture
def where(mnt: Path, mounts: dict[str, Path]) -> Callable[[str], Path]:
    """The test's directory as seen through mount *name*."""
    return lambda name: mounts[name] / mnt.name


def meta_calls(cluster: ProcessCluster) -> dict[str, int]:
    return cluster.meta_calls()


def eventually_reads(p: Path, want: bytes) -> float:
    """Seconds until an open of *p* reads *want* (fails after BOUND + SLACK)."""
    t0 = time.monotonic()
    while True:
        try:
            if read(p) == want:
                return time.monotonic() - t0
        except FileNotFoundError:
            pass
        assert time.monotonic() - t0 < BOUND + SLACK, f"{p} never read the new content"
        time.sleep(0.05)


def test_status_lists_every_mount_with_its_options(
    mounted: ProcessCluster, mounts: dict[str, Path]
) -> None:
    out = shufflefs("status", "--json", "--config", str(mounted.client_config)).stdout
    listed = {m["mountpoint"]: m for m in json.loads(out)["mounts"]}
    for name in "AB":
        m = listed[str(mounts[name])]
        assert (m["mode"], m["attr_timeout"], m["entry_timeout"], m["negative_timeout"]) == (
            "rw",
            1.0,
            1.0,
            0.0,
        )
    assert listed[str(mounts["R"])]["mode"] == "ro"
    assert listed[str(mounts["I"])]["mode"] == "immutable"
    assert listed[str(mounts["R"])]["attr_timeout"] == 300.0
    s = listed[str(mounts["S"])]
    assert (s["mode"], s["attr_timeout"], s["entry_timeout"], s["negative_timeout"]) == (
        "ro",
        BOUND,
        BOUND,
        BOUND,
    )
    assert all(m["pid"] > 0 and m["host"] for m in listed.values())
    text = shufflefs("status", "--config", str(mounted.client_config)).stdout
    mounts_section = text.split("\nMOUNTS\n", 1)[1]
    for mountpoint in mounts.values():
        assert str(mountpoint) in mounts_section
    assert "ro          300s   300s     300s" in mounts_section


def test_default_mount_close_to_open_and_cached_open(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    a, b = where("A"), where("B")
    (a / "f").write_bytes(b"A" * 5000)
    assert read(b / "f") == b"A" * 5000  # B opens afresh and keeps the handle
    before = meta_calls(mounted)
    for _ in range(10):
        assert read(b / "f") == b"A" * 5000
    after = meta_calls(mounted)
    # neither reopened nor revalidated: B's cache watch keeps the entry fresh
    # (at most the kernel asking for attributes again after attr_timeout)
    asked = {m: after.get(m, 0) - before.get(m, 0) for m in ("open", "getattr", "getattrs")}
    assert asked["open"] == 0 and asked["getattr"] + asked["getattrs"] <= 3, asked
    # close-to-open: closed on A, seen by B's next open (same size: only the
    # inode's change counter tells the versions apart)
    rewrite_in_place(a / "f", b"B" * 5000)
    assert read(b / "f") == b"B" * 5000
    (a / "f").write_bytes(b"shorter")
    assert read(b / "f") == b"shorter"


def test_default_mount_keeps_names_and_attributes_of_watched_files_fresh(
    where: Callable[[str], Path],
) -> None:
    """B caches the file (its cache watch keeps it fresh, so the kernel may
    keep its name and attributes longer than attr_timeout): a change closed
    on A was told to B first, which dropped the kernel's attributes before
    acknowledging it, so a stat right after A's close sees it; a rename over
    the name reaches B's kernel entry as soon as its queued invalidation runs."""
    a, b = where("A"), where("B")
    (a / "w").write_bytes(b"x" * 1000)
    assert read(b / "w") == b"x" * 1000
    with open(a / "w", "ab") as f:
        f.write(b"y" * 500)
    assert os.stat(b / "w").st_size == 1500
    assert read(b / "w") == b"x" * 1000 + b"y" * 500
    (a / "w2").write_bytes(b"z" * 10)
    os.rename(a / "w2", a / "w")
    eventually_reads(b / "w", b"z" * 10)
    assert os.stat(b / "w").st_size == 10


def test_default_mount_answers_lookups_of_watched_files_itself(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    """Once the kernel no longer holds the entry of a watched file (expired
    after the watch's lease, or evicted), B answers the LOOKUP (and a
    GETATTR) from its cache, with no metadata call, as long as the watch
    keeps the file fresh; a rename over the name on A, and B's own unlink
    followed by A's create, are seen at once."""
    a, b = where("A"), where("B")
    (a / "f").write_bytes(b"1" * 100)
    assert read(b / "f") == b"1" * 100
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # the kernel drops its entries
    os.stat(b)  # the directory's entry is looked up again: not in the count
    before = meta_calls(mounted)
    assert os.stat(b / "f").st_size == 100
    assert read(b / "f") == b"1" * 100
    after = meta_calls(mounted)
    for method in ("lookup", "lookup_open", "getattr", "getattrs", "open"):
        assert after.get(method, 0) == before.get(method, 0), method
    (a / "g").write_bytes(b"2" * 50)
    os.rename(a / "g", a / "f")
    assert read(b / "f") == b"2" * 50  # told before A's rename returned
    os.unlink(b / "f")
    (a / "f").write_bytes(b"3" * 30)
    assert read(b / "f") == b"3" * 30


def test_a_first_listing_costs_a_round_trip_per_page_and_none_for_its_end(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    """Listing a directory of two metadata pages reads each page once; the
    kernel's last READDIRPLUS, past the end, is answered without asking
    (it was an empty page's round trip per directory: half the calls of a
    cold scan of small class directories). (On a mount that reads no
    listings ahead: two sibling listings are a walk to one that does,
    fuse/list_ahead.py.)"""
    a, b = where("A"), where("L")
    (a / "two").mkdir()
    names = [f"f{k:03d}" for k in range(300)]  # READDIR_PAGE is 256
    for name in names:
        (a / "two" / name).write_bytes(b"")
    (a / "empty").mkdir()
    os.stat(b / "two")
    os.stat(b / "empty")
    before = meta_calls(mounted)
    assert sorted(os.listdir(b / "two")) == names
    assert os.listdir(b / "empty") == []
    after = meta_calls(mounted)
    calls = {m: after.get(m, 0) - before.get(m, 0) for m in ("watch_dir", "readdir")}
    assert calls == {"watch_dir": 2, "readdir": 1}


def test_a_renamed_watched_directory_is_not_found_by_its_old_name(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    """A directory listed (so watched) and renamed, then listed again under
    its new name (watched again): its old name leads nowhere, on the mount
    that renamed it and on another (found by the model test: the old name
    was answered from the new watch)."""
    for renamer, other in (("A", "B"), ("B", "A")):
        r, o = where(renamer), where(other)
        (r / "old").mkdir()
        (r / "old" / "f").write_bytes(b"x")
        for m in (r, o):
            assert os.listdir(m / "old") == ["f"]
            assert "old" in os.listdir(m)
        os.rename(r / "old", r / "new")
        for m in (r, o):
            assert os.listdir(m / "new") == ["f"]
            assert sorted(os.listdir(m)) == sorted(os.listdir(r))
            assert "old" not in os.listdir(m)
        assert not (r / "old").exists()
        wait_until("the old name to go", lambda o=o: not (o / "old").exists(), SLACK)
        assert not (r / "old").exists()
        (r / "new" / "f").unlink()
        (r / "new").rmdir()


def test_default_mount_keeps_listings_its_watch_keeps_fresh(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    """B's later listings of a directory ask the metadata server nothing
    (the kernel keeps the listing while B's cache watch says the directory
    is unchanged); a name created, removed or renamed on A, or a directory made there, is
    in B's next listing at once, and so are B's own changes. The
    directory's LOOKUP is answered from the watch as well."""
    a, b = where("A"), where("B")
    (a / "d").mkdir()
    names = [f"f{k:03d}" for k in range(300)]  # two pages of the metadata server's
    for name in names:
        (a / "d" / name).write_bytes(b"")
    assert sorted(os.listdir(b / "d")) == names
    # the parent's listing names "d", watched by now: B keeps that name too
    assert "d" in os.listdir(b)
    before = meta_calls(mounted)
    for _ in range(3):
        assert sorted(os.listdir(b / "d")) == names
        assert sorted(e.name for e in os.scandir(b / "d")) == names
    after = meta_calls(mounted)
    # (getattr is not counted: on a slow moment the path's directories'
    # attributes expire, and their GETATTRs are not the listing's)
    for method in ("readdir", "watch_dir"):
        assert after.get(method, 0) == before.get(method, 0), method
    # once the kernel has forgotten the directory, its LOOKUP is answered
    # from the watch too (the listing itself is read afresh: the kernel's is gone)
    # (a GETATTR of the mount's root may come with it when the root's
    # attributes expired on a slow moment: up to three tries for one that
    # asks nothing at all; the LOOKUP is never asked in any of them)
    nlink = os.stat(a / "d").st_nlink
    getattrs = []
    for _ in range(3):
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        os.stat(b)
        before = meta_calls(mounted)
        assert os.stat(b / "d").st_nlink == nlink
        after = meta_calls(mounted)
        for method in ("lookup", "lookup_open"):
            assert after.get(method, 0) == before.get(method, 0), method
        getattrs.append(after.get("getattr", 0) - before.get("getattr", 0))
        if getattrs[-1] == 0:
            break
    assert getattrs[-1] == 0, getattrs
    changes: list[tuple[Callable[[], object], Callable[[list[str]], bool]]] = [
        (lambda: (a / "d" / "new").write_bytes(b"x"), lambda ls: "new" in ls),
        (lambda: os.unlink(a / "d" / "f000"), lambda ls: "f000" not in ls),
        (lambda: os.rename(a / "d" / "f001", a / "d" / "g001"), lambda ls: "g001" in ls),
        (lambda: (a / "d" / "sub").mkdir(), lambda ls: "sub" in ls),
        (lambda: (b / "d" / "mine").write_bytes(b""), lambda ls: "mine" in ls),
        (lambda: os.unlink(b / "d" / "mine"), lambda ls: "mine" not in ls),
    ]
    for change, seen in changes:
        change()
        listed = os.listdir(b / "d")
        assert seen(listed) and sorted(listed) == sorted(os.listdir(a / "d")), change
    assert (b / "d" / "sub").is_dir()
    # a directory B lists (and so watches), removed on A, then by B itself,
    # and replaced by a file: gone from B's listing at once, its name leads
    # nowhere (B's kernel may keep the name entry_timeout: the rw model),
    # then to the file
    for remover, maker in ((a, b), (b, a)):
        assert os.listdir(b / "d" / "sub") == []
        os.stat(b / "d" / "sub")
        os.rmdir(remover / "d" / "sub")
        assert "sub" not in os.listdir(b / "d")
        wait_until("the removed name to go", lambda: not (b / "d" / "sub").exists(), SLACK)
        (maker / "d" / "sub").write_bytes(b"file")
        assert (b / "d" / "sub").is_file() and read(b / "d" / "sub") == b"file"
        os.unlink(a / "d" / "sub")
        (maker / "d" / "sub").mkdir()


@pytest.mark.parametrize("mode", ["R", "I"])
def test_ro_mount_refuses_every_mutation(where: Callable[[str], Path], mode: str) -> None:
    a, r = where("A"), where(mode)
    (a / "f").write_bytes(b"data")
    (a / "d").mkdir()
    attempts: list[Callable[[], object]] = [
        lambda: os.open(r / "f", os.O_WRONLY),
        lambda: os.open(r / "f", os.O_RDONLY | os.O_TRUNC),
        lambda: os.open(r / "new", os.O_WRONLY | os.O_CREAT, 0o644),
        lambda: os.mkdir(r / "d2"),
        lambda: os.unlink(r / "f"),
        lambda: os.rmdir(r / "d"),
        lambda: os.rename(r / "f", r / "g"),
        lambda: os.symlink("f", r / "s"),
        lambda: os.link(r / "f", r / "h"),
        lambda: os.chmod(r / "f", 0o600),
        lambda: os.truncate(r / "f", 0),
        lambda: os.setxattr(r / "f", "user.x", b"1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as err:
            attempt()
        assert err.value.errno == errno.EROFS
    assert read(r / "f") == b"data"  # and nothing changed
    assert sorted(os.listdir(a)) == ["d", "f"]


@pytest.mark.parametrize("mode", ["R", "I"])
def test_ro_open_makes_no_metadata_call(
    mounted: ProcessCluster, where: Callable[[str], Path], mode: str
) -> None:
    a, r = where("A"), where(mode)
    (a / "f").write_bytes(os.urandom(110_000))
    want = read(r / "f")
    before = meta_calls(mounted)
    for _ in range(20):
        assert read(r / "f") == want
    after = meta_calls(mounted)
    for method in ("open", "release", "getattr", "lookup"):
        assert after.get(method, 0) == before.get(method, 0), method


@pytest.mark.parametrize("mode", ["B", "R", "I"])
def test_first_read_makes_one_metadata_call(
    mounted: ProcessCluster, where: Callable[[str], Path], mode: str
) -> None:
    """A sample read for the first time: its lookup opens it too (on the
    read-write mount B as well: its cache watch keeps that handle fresh)."""
    a, r = where("A"), where(mode)
    data = os.urandom(110_000)
    (a / "first").write_bytes(data)
    os.stat(r)  # the directory (its lookup opens nothing)
    before = meta_calls(mounted)
    assert read(r / "first") == data
    after = meta_calls(mounted)
    assert after.get("lookup_open", 0) == before.get("lookup_open", 0) + 1
    for method in ("open", "open_read_only", "getattr", "getattrs", "lookup"):
        assert after.get(method, 0) == before.get(method, 0), method


@pytest.mark.parametrize("mode", ["S", "J"])
def test_ro_mount_sees_a_change_made_elsewhere_within_its_timeouts(
    where: Callable[[str], Path], mode: str
) -> None:
    a, s = where("A"), where(mode)
    (a / "f").write_bytes(b"one" * 1000)
    assert read(s / "f") == b"one" * 1000  # cached: handle, layout, pages
    rewrite_in_place(a / "f", b"two" * 1000)  # same size, same inode
    eventually_reads(s / "f", b"two" * 1000)
    (a / "f").write_bytes(b"three, longer" * 1000)  # truncate and grow
    eventually_reads(s / "f", b"three, longer" * 1000)
    # a name it missed (cached negative) and another file renamed over one it read
    assert not (s / "new").exists()
    (a / "new").write_bytes(b"new")
    eventually_reads(s / "new", b"new")
    (a / "tmp").write_bytes(b"replacement")
    os.rename(a / "tmp", a / "f")
    eventually_reads(s / "f", b"replacement")
    # listings (cached whole by the kernel on an immutable mount)
    assert sorted(os.listdir(s)) == ["f", "new"]
    (a / "listed").write_bytes(b"")
    eventually_lists(s, ["f", "listed", "new"])
    os.unlink(a / "new")
    eventually_lists(s, ["f", "listed"])


def eventually_lists(d: Path, want: list[str]) -> None:
    wait_until(f"{d} to list {want}", lambda: sorted(os.listdir(d)) == want, BOUND + SLACK)


def read_direct(p: Path, offset: int, length: int) -> bytes:
    """O_DIRECT: every read reaches the mount (a READ naming the inode)."""
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, length)  # page aligned
        n = os.preadv(fd, [buf], offset)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def test_immutable_mount_reads_exact_bytes_at_every_edge(
    mounted: ProcessCluster, where: Callable[[str], Path]
) -> None:
    a, i = where("A"), where("I")
    sizes = [0, 1, 4095, 4096, 110_000, (1 << 20) + 5, 3 * (1 << 20) + 4097]
    files = {n: os.urandom(n) for n in sizes}
    for n, data in files.items():
        (a / f"f{n}").write_bytes(data)
    for n, data in files.items():
        assert read_direct(i / f"f{n}", 0, n + 8192) == data  # cold, through the mount
        for off in (4096, 1 << 20, 2 << 20):
            assert read_direct(i / f"f{n}", off, 8192) == data[off : off + 8192]
        assert read(i / f"f{n}") == data  # buffered
        if n:
            with open(i / f"f{n}", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                assert m[:] == data
    # a directory listed in many READDIRPLUS requests (each resumes at an
    # offset handed out before), by several processes at once, twice
    big = a / "big"
    big.mkdir()
    names = sorted(f"{k:04d}-{'x' * 100}" for k in range(700))
    for name in names:
        (big / name).write_bytes(b"")
    lister = "import os, sys; print(len(os.listdir(sys.argv[1])))"
    for _ in range(2):
        procs = [
            subprocess.Popen([sys.executable, "-c", lister, str(i / "big")], stdout=subprocess.PIPE)
            for _ in range(3)
        ]
        assert [p.communicate(timeout=60)[0].strip() for p in procs] == [b"700"] * 3
        assert sorted(os.listdir(i / "big")) == names
    assert {e.name: e.is_file() for e in os.scandir(i / "big")} == dict.fromkeys(names, True)
    # many readers at once, each file read by several (one handle per inode)
    reader = "import sys\nfor p in sys.argv[1:]: open(p, 'rb').read()\n"
    names = [str(i / f"f{n}") for n in sizes] * 3
    procs = [subprocess.Popen([sys.executable, "-c", reader, *names]) for _ in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 4


def test_immutable_warm_reads_need_no_mount_process(
    mounted: ProcessCluster, mounts: dict[str, Path], where: Callable[[str], Path]
) -> None:
    a, i = where("A"), where("I")
    data = os.urandom(300_000)
    (a / "warm").write_bytes(data)
    assert read(i / "warm") == data
    out = shufflefs("status", "--json", "--config", str(mounted.client_config)).stdout
    pid = next(m["pid"] for m in json.loads(out)["mounts"] if m["mountpoint"] == str(mounts["I"]))
    # unbuffered: Python's buffered open asks whether the file is a terminal
    # (ioctl TCGETS), which the kernel hands to the filesystem every time
    reader = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb', buffering=0).read())"
    lister = "import os, sys; print(' '.join(sorted(os.listdir(sys.argv[1]))))"
    assert sorted(os.listdir(i)) == ["warm"]
    # These VMs page out "cold" memory proactively (DAMON), page cache too: a
    # page read a moment ago may be gone, and its READ would reach the
    # stopped mount. mlock pins the file's pages for the test (reading any
    # that went first), as a page cache under no such pressure keeps them.
    with open(i / "warm", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        pinned = np.frombuffer(m, dtype=np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mlock(ctypes.c_void_p(pinned.ctypes.data), ctypes.c_size_t(len(m))) == 0
        try:
            got, listed = warm_reads_while_stopped(pid, reader, lister, i)
        finally:
            libc.munlock(ctypes.c_void_p(pinned.ctypes.data), ctypes.c_size_t(len(m)))
            del pinned
    assert got.returncode == 0 and got.stdout == data
    assert listed.returncode == 0 and listed.stdout == b"warm\n"


def warm_reads_while_stopped(
    pid: int, reader: str, lister: str, d: Path
) -> tuple[subprocess.CompletedProcess[bytes], subprocess.CompletedProcess[bytes]]:
    os.kill(pid, signal.SIGSTOP)
    try:
        # open, read and close, and a listing, while the mount cannot answer
        got = subprocess.run(
            [sys.executable, "-c", reader, str(d / "warm")], capture_output=True, timeout=20
        )
        listed = subprocess.run(
            [sys.executable, "-c", lister, str(d)], capture_output=True, timeout=20
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    return got, listed
