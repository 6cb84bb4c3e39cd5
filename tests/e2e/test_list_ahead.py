"""Listings of a walk's next directories read ahead (fuse/list_ahead.py,
``-o list_ahead=N``), with real mounts of one cluster: once a directory's
subdirectories were listed and the first of them is, the others' listings
(and, on ``ro`` and ``cache=immutable``, their lookups) make no metadata
call, and give exactly the names there are; a held listing follows every
change made on another mount or on the mount itself as the mode promises
(read-write: at once; ``ro``: within its timeouts); ``list_ahead=0`` turns
it off."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, wait_until
from opsworld import MeteredMount, metered_mounts

from shufflefs.fuse.dir_handles import READDIR_PAGE

# they drop the kernel's caches: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

FAMILY = "shufflefs_client_list_ahead"
DIRS = 8
FILES = 3
BOUND = 2.0  # the short ro mount's timeouts
SLACK = 10.0  # what the test allows beyond the bound on a busy machine
SHORT = f"attr_timeout={BOUND},entry_timeout={BOUND}"
WALK_CALLS = ("readdir", "watch_dir", "lookup", "lookup_open", "getattr")


@pytest.fixture(scope="module")
def mounts(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, MeteredMount]]:
    """B (read-write, 10-second timeouts: a held page is good that long, not
    1 s, however slowly the machine drops its caches), R (-o ro), F (the
    same, for one test: no listing of another test's directory before its
    own), S (-o ro, BOUND-second timeouts), I (cache=immutable), N
    (list_ahead=0): each a mount of its own."""
    options = {
        "B": "attr_timeout=10,entry_timeout=10",
        "R": "ro",
        "F": "ro",
        "S": f"ro,{SHORT}",
        "I": "cache=immutable",
        "N": "list_ahead=0",
    }
    with metered_mounts(mounted, tmp_path_factory, "list-ahead", options, FAMILY, "what") as mounts:
        yield mounts


@pytest.fixture
def tree(mnt: Path) -> dict[str, set[str]]:
    """DIRS subdirectories of the test's directory, FILES files each
    (written through the session's mount): subdirectory -> its names."""
    out: dict[str, set[str]] = {}
    for i in range(DIRS):
        d = mnt / f"d{i:02d}"
        d.mkdir()
        out[d.name] = set()
        for j in range(FILES):
            (d / f"f{j}").write_bytes(b"x" * (i + j))
            out[d.name].add(f"f{j}")
    return out


def walk_start(m: MeteredMount, top: Path, ahead: int = DIRS - 1) -> None:
    """List *top*, then its first subdirectory, and wait until the next
    *ahead* listings are held; then drop the kernel's entries, as a cold
    walk finds them."""
    fetched = m.count("fetched")
    assert sorted(os.listdir(top)) == [f"d{i:02d}" for i in range(DIRS)]
    os.listdir(top / "d00")
    wait_until("the next listings held", lambda: m.count("fetched") >= fetched + ahead, timeout=20)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    os.stat(top)  # (its own lookup is not the walk's)


def walk_calls(cluster: ProcessCluster) -> dict[str, int]:
    calls = cluster.meta_calls()
    return {k: calls.get(k, 0) for k in WALK_CALLS}


@pytest.mark.parametrize("mode", ["B", "R", "I"])
def test_a_walks_next_listings_make_no_metadata_call(
    mounted: ProcessCluster,
    mounts: dict[str, MeteredMount],
    mnt: Path,
    tree: dict[str, set[str]],
    mode: str,
) -> None:
    m = mounts[mode]
    top = m.mountpoint / mnt.name
    walk_start(m, top)
    taken = m.count("taken")
    before = walk_calls(mounted)
    for i in range(1, DIRS):
        name = f"d{i:02d}"
        assert set(os.listdir(top / name)) == tree[name]
    assert walk_calls(mounted) == before
    assert m.count("taken") == taken + DIRS - 1
    # and what they brought reads right
    assert (top / "d05" / "f2").read_bytes() == b"x" * 7


def test_a_walk_that_never_lists_the_top_is_read_ahead_too(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, tree: dict[str, set[str]]
) -> None:
    """A walker that knows the subdirectories' names (a loader's class list)
    and lists them without listing their directory: one listing alone reads
    nothing ahead; the second makes the mount list the directory itself to
    learn their order, and the rest of the walk asks nothing."""
    r = mounts["R"]
    top = r.mountpoint / mnt.name
    fetched, queued, learned = r.count("fetched"), r.count("queued"), r.count("learned")
    assert set(os.listdir(top / "d00")) == tree["d00"]
    # (what a listing reads ahead is decided, and counted, before it returns)
    assert r.count("queued") == queued and r.count("learned") == learned
    assert set(os.listdir(top / "d01")) == tree["d01"]
    wait_until(
        "the walk's next listings held",
        lambda: r.count("fetched") >= fetched + DIRS - 2,
        timeout=20,
    )
    assert r.count("learned") == learned + 1
    before = walk_calls(mounted)
    for i in range(2, DIRS):
        assert set(os.listdir(top / f"d{i:02d}")) == tree[f"d{i:02d}"]
    assert walk_calls(mounted) == before


def test_held_listings_follow_changes_of_another_mount_and_of_its_own(
    mounts: dict[str, MeteredMount], mnt: Path, tree: dict[str, set[str]]
) -> None:
    """Read-write: a change made on another mount is told to the cache watch
    before it returns, one made here drops what was listed of its directory:
    the held listing is not used for either."""
    b = mounts["B"]
    top = b.mountpoint / mnt.name
    walk_start(b, top)
    stale = b.count("stale")
    (mnt / "d01" / "new").write_bytes(b"made elsewhere")
    os.unlink(mnt / "d02" / "f0")
    os.rename(mnt / "d03" / "f1", mnt / "d04" / "moved")
    os.unlink(top / "d05" / "f2")  # here
    (top / "d06" / "mine").write_bytes(b"made here")
    os.mkdir(top / "d07" / "sub")
    assert set(os.listdir(top / "d01")) == tree["d01"] | {"new"}
    assert set(os.listdir(top / "d02")) == tree["d02"] - {"f0"}
    assert set(os.listdir(top / "d03")) == tree["d03"] - {"f1"}
    assert set(os.listdir(top / "d04")) == tree["d04"] | {"moved"}
    assert set(os.listdir(top / "d05")) == tree["d05"] - {"f2"}
    assert set(os.listdir(top / "d06")) == tree["d06"] | {"mine"}
    assert set(os.listdir(top / "d07")) == tree["d07"] | {"sub"}
    assert b.count("stale") >= stale + 6


def test_a_read_only_mount_shows_a_change_within_its_timeouts(
    mounts: dict[str, MeteredMount], mnt: Path, tree: dict[str, set[str]]
) -> None:
    """``ro`` with short timeouts: a listing held ahead is not taken once it
    is older than them, so a name removed elsewhere is gone from the
    listing within the mode's bound."""
    s = mounts["S"]
    top = s.mountpoint / mnt.name
    walk_start(s, top)
    os.unlink(mnt / "d03" / "f0")
    wait_until(
        "the removed name to go from the listing",
        lambda: "f0" not in os.listdir(top / "d03"),
        BOUND + SLACK,
    )
    assert set(os.listdir(top / "d03")) == tree["d03"] - {"f0"}


def test_nothing_is_listed_ahead_before_a_walk_or_with_zero(
    mounts: dict[str, MeteredMount], mnt: Path, tree: dict[str, set[str]]
) -> None:
    """A listing of the top alone (``ls``) reads nothing ahead; the first
    listing of one of its subdirectories starts it; ``list_ahead=0`` never."""
    f, n = mounts["F"], mounts["N"]
    os.listdir(f.mountpoint / mnt.name)
    # (what a listing reads ahead is decided, and counted, before it returns)
    assert f.count("queued") == f.count("learned") == 0
    os.listdir(f.mountpoint / mnt.name / "d00")
    assert f.count("queued") == DIRS - 1
    wait_until("the walk's next listings", lambda: f.count("fetched") == DIRS - 1, timeout=20)
    os.listdir(n.mountpoint / mnt.name)
    for i in range(DIRS):
        assert set(os.listdir(n.mountpoint / mnt.name / f"d{i:02d}")) == tree[f"d{i:02d}"]
    assert n.count("fetched") == n.count("taken") == 0


@pytest.mark.parametrize("mode", ["B", "R", "I"])
def test_a_large_directorys_next_page_is_read_while_the_kernel_takes_one(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, mode: str
) -> None:
    """A listing of a directory of several pages reads each next page while
    the kernel takes the one before (fuse/listings.py): every later page is
    read ahead and used, each page is asked of the metadata server once, and
    the names are exactly the directory's, each once, also when some are
    removed and others made between pages."""
    m = mounts[mode]
    big = mnt / "big"
    big.mkdir()
    names = {f"n{i:04d}" for i in range(2 * READDIR_PAGE + 90)}  # three pages
    for name in names:
        os.mknod(big / name)
    read, taken = m.count("next_read"), m.count("next_taken")
    before = walk_calls(mounted)
    assert sorted(os.listdir(m.mountpoint / mnt.name / "big")) == sorted(names)
    after = walk_calls(mounted)
    assert after["readdir"] + after["watch_dir"] - before["readdir"] - before["watch_dir"] == 3
    assert m.count("next_read") == read + 2 and m.count("next_taken") == taken + 2
    # changes between pages: what stays is listed once, nothing twice
    seen: list[str] = []
    with os.scandir(big) as it:  # (through the session's read-write mount)
        for entry in it:
            seen.append(entry.name)
            if len(seen) == READDIR_PAGE // 2:
                for i in range(READDIR_PAGE, READDIR_PAGE + 40):
                    os.unlink(big / f"n{i:04d}")
                    os.mknod(big / f"m{i:04d}")
    gone = {f"n{i:04d}" for i in range(READDIR_PAGE, READDIR_PAGE + 40)}
    assert len(seen) == len(set(seen))
    assert (
        names - gone
        <= set(seen)
        <= names | {f"m{i:04d}" for i in range(READDIR_PAGE, READDIR_PAGE + 40)}
    )


@pytest.mark.parametrize("mode", ["B", "R", "I"])
def test_a_listing_goes_on_when_the_kernel_loses_its_cached_listing(
    mounts: dict[str, MeteredMount], mnt: Path, mode: str
) -> None:
    """The kernel keeps a directory's listing across opens, with the offsets
    of the listing that filled it. When it loses a page of it during a later
    listing (memory pressure; here drop_caches), it drops the rest and goes
    on uncached from the offset it stood at, under the new listing's handle.
    Offsets are the directory's, not a handle's (fuse/dir_handles.py,
    `Offsets`): the listing goes on and gives every name once (before, the
    read-write and ``ro`` mounts answered EINVAL: ``ls`` failed)."""
    m = mounts[mode]
    d = mnt / "evicted"
    d.mkdir()
    # long names: a getdents of glibc's 32 KiB takes ~270, so the listing below
    # stops after its first getdents with most of the kernel's copy unread
    names = {f"{i:04d}-" + "x" * 95 for i in range(600)}
    for name in names:
        os.mknod(d / name)
    path = m.mountpoint / mnt.name / "evicted"
    assert set(os.listdir(path)) == names  # the kernel keeps this listing
    seen: list[str] = []
    with os.scandir(path) as it:  # answered from the kernel's copy
        seen.append(next(it).name)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")  # its pages gone
        seen.extend(e.name for e in it)
    assert len(seen) == len(set(seen))
    assert set(seen) == names
