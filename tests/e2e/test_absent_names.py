"""The LOOKUP a create starts with, answered by a read-write mount with no
metadata call once its cache watch holds the directory's names
(client/cache_watch.py, `absent`), with real mounts of one cluster: a
directory's names are listed after the mount's first create in it;
the mount's own creates keep them (the server does not tell a session of its
own creates, metadata/cache_watch.py); anything another mount does to the
directory, and this mount's other changes of it, drop them before they
return, so a name made or removed elsewhere is seen at once."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster
from harness import read_whole as read
from opsworld import MeteredMount, metered_mount, samples

FAMILY = "shufflefs_client_fast_answers"
NAME_CALLS = ("lookup", "lookup_open")
FILES = 40


@pytest.fixture(scope="module")
def other(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MeteredMount]:
    """B: a default mount of its own, whose absent answers are counted."""
    yield from metered_mount(mounted, tmp_path_factory.mktemp("absent-names-B"), "", FAMILY, "op")


def name_calls(cluster: ProcessCluster) -> int:
    calls = cluster.meta_calls()
    return sum(calls.get(k, 0) for k in NAME_CALLS)


def test_creates_in_a_directory_ask_no_lookup_and_changes_elsewhere_are_seen(
    mounted: ProcessCluster, other: MeteredMount, mnt: Path
) -> None:
    d = other.mountpoint / mnt.name / "new"
    d.mkdir()
    # a lookup that finds nothing does not list (nor watch) the directory
    listings = mounted.meta_calls().get("watch_dir", 0)
    assert not (d / "nothing").exists()
    assert mounted.meta_calls().get("watch_dir", 0) == listings
    (d / "first").write_bytes(b"1")  # its lookup asks; after its create, the names are listed
    absent = other.count("absent")
    before = name_calls(mounted)
    for i in range(FILES):
        (d / f"f{i:03d}").write_bytes(b"x" * i)
    # each open(O_CREAT)'s LOOKUP answered by the mount (the directory's own
    # entry may expire meanwhile and be looked up again: a few calls)
    assert other.count("absent") - absent >= FILES
    assert name_calls(mounted) - before < FILES // 4
    gauge = samples(other.metrics)["shufflefs_client_watched_dirs"]
    held = {g.labels["what"]: g.value for g in gauge}
    assert held["named"] >= 1 and held["names"] >= FILES + 1
    assert sorted(os.listdir(d)) == sorted(["first"] + [f"f{i:03d}" for i in range(FILES)])
    for i in range(FILES):
        assert read(d / f"f{i:03d}") == b"x" * i
    # a name made, removed or renamed through the other mount: seen at once
    a = mnt / "new"
    (a / "theirs").write_bytes(b"made elsewhere")
    assert read(d / "theirs") == b"made elsewhere"
    with pytest.raises(FileExistsError):
        os.open(d / "theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    # (a name this mount created, the kernel may keep entry_timeout: the
    # read-write model; one it looked up, the watch takes back at once)
    os.rename(a / "theirs", a / "renamed")
    assert read(d / "renamed") == b"made elsewhere"
    assert not (d / "theirs").exists()
    os.unlink(a / "renamed")
    assert not (d / "renamed").exists()
    (a / "sub").mkdir()
    assert (d / "sub").is_dir()
    # its names listed again (at most every RELEARN seconds), creates go on
    (d / "later").write_bytes(b"2")
    assert read(a / "later") == b"2"


def test_the_mounts_own_changes_keep_its_names_right(
    mounted: ProcessCluster, other: MeteredMount, mnt: Path
) -> None:
    """Its own unlink, rename, mkdir, symlink and link in a directory whose
    names it holds: every name looked up afterwards is what the other mount
    sees."""
    d = other.mountpoint / mnt.name
    (d / "a").write_bytes(b"a")
    (d / "b").write_bytes(b"b")
    os.unlink(d / "a")
    assert not (d / "a").exists()
    (d / "a").write_bytes(b"again")
    os.rename(d / "b", d / "c")
    assert not (d / "b").exists() and read(d / "c") == b"b"
    (d / "b").write_bytes(b"new b")
    (d / "dir").mkdir()
    os.symlink("c", d / "link")
    os.link(d / "c", d / "hard")
    for name in ("x1", "x2"):
        (d / name).write_bytes(name.encode())
    with pytest.raises(OSError) as exc:
        os.open(d / "x1", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert exc.value.errno == errno.EEXIST
    want = sorted(["a", "b", "c", "dir", "link", "hard", "x1", "x2"])
    assert sorted(os.listdir(d)) == want == sorted(os.listdir(mnt))
    for name in want:
        assert os.path.lexists(d / name) and os.path.lexists(mnt / name), name
    assert read(d / "link") == b"b" and read(d / "hard") == b"b" and read(d / "b") == b"new b"
