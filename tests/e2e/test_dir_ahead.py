"""A directory's files opened ahead on the first lookup that missed the
mount's caches (fuse/dir_ahead.py, ``-o dir_ahead=N``), with real mounts of
one cluster: once one name of a directory was looked up on a fresh mount,
the others open and read with no metadata call; what a name learned that
way leads to follows every change made on another mount (read-write: told by
the cache watch at once; ``-o ro`` and ``cache=immutable``: within their
``entry_timeout``); the bound
on entries holds; ``dir_ahead=0`` turns it off."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, wait_until
from harness import read_whole as read
from opsworld import MeteredMount, metered_mounts

from shufflefs.fuse.prefetch_hints import PREFETCH_XATTR

# they drop the kernel's caches, or count what those spare: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

FAMILY = "shufflefs_client_dir_ahead"
FILES = 30
BOUND = 1.0  # the short ro mount's timeouts
SLACK = 10.0  # what the test allows beyond the bound on a busy machine
SHORT = f"attr_timeout={BOUND},entry_timeout={BOUND},negative_timeout={BOUND}"
NAME_CALLS = ("lookup", "lookup_open", "open", "open_read_only", "getattr", "getattrs")


@pytest.fixture(scope="module")
def mounts(
    mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, MeteredMount]]:
    """B (default, but the kernel keeps the test directory's entry for the
    whole test), R (-o ro, BOUND-second timeouts), I (the same with
    cache=immutable), E (dir_ahead=8), N (dir_ahead=0), L and J (-o ro and
    cache=immutable keeping entries a minute), H (as B, for a loader that
    hints): each a mount of its own, so none knows the test's files."""
    options = {
        "B": "attr_timeout=60,entry_timeout=60",
        "R": f"ro,{SHORT}",
        "I": f"cache=immutable,{SHORT}",
        "E": "dir_ahead=8",
        "N": "dir_ahead=0",
        "L": "ro,attr_timeout=60,entry_timeout=60",
        "J": "cache=immutable,attr_timeout=60,entry_timeout=60",
        "H": "attr_timeout=60,entry_timeout=60",
    }
    with metered_mounts(mounted, tmp_path_factory, "dir-ahead", options, FAMILY, "what") as mounts:
        yield mounts


def content(i: int) -> bytes:
    return f"sample {i:03d} ".encode() * (100 + i)


@pytest.fixture
def names(mnt: Path) -> list[str]:
    """FILES files in the test's directory (written through the session's
    mount), and a subdirectory (not opened ahead)."""
    out = [f"f{i:03d}" for i in range(FILES)]
    for i, name in enumerate(out):
        (mnt / name).write_bytes(content(i))
    (mnt / "sub").mkdir()
    return out


def first_miss(m: MeteredMount, d: Path, name: str) -> float:
    """Look *name* up with the kernel's entries dropped (a miss in the
    mount's caches), wait until the directory was opened ahead, and return
    how many files were."""
    dirs, files = m.count("dirs"), m.count("files")
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    os.stat(d / name)
    wait_until("the directory opened ahead", lambda: m.count("dirs") > dirs, timeout=20)
    return m.count("files") - files


def name_calls(cluster: ProcessCluster) -> dict[str, int]:
    calls = cluster.meta_calls()
    return {k: calls.get(k, 0) for k in NAME_CALLS}


def test_the_other_files_of_a_directory_open_with_no_metadata_call(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    b = mounts["B"]
    d = b.mountpoint / mnt.name
    dirs = b.count("dirs")
    assert first_miss(b, d, names[0]) == FILES - 1
    assert b.count("dirs") == dirs + 1
    before = name_calls(mounted)
    for i, name in enumerate(names):
        assert os.stat(d / name).st_size == len(content(i))
        assert read(d / name) == content(i)
    assert name_calls(mounted) == before
    # the next miss in the same directory lists nothing again
    os.stat(d / "sub")
    assert b.count("dirs") == dirs + 1


@pytest.mark.parametrize("mode", ["B", "L", "J"])
def test_a_listed_directory_is_opened_ahead_by_the_first_open_of_one_of_its_files(
    mounted: ProcessCluster,
    mounts: dict[str, MeteredMount],
    mnt: Path,
    names: list[str],
    mode: str,
) -> None:
    """A loader that walks its dataset before reading it (an ImageFolder):
    the listing gave the kernel every name, so no LOOKUP misses. The first
    open of one of the files that the open cache cannot answer (read-write,
    ``ro``: the OPEN; ``cache=immutable``: the first READ) opens the rest of
    its directory ahead, and they open and read with no metadata call."""
    m = mounts[mode]
    d = m.mountpoint / mnt.name
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert sorted(os.listdir(d)) == sorted([*names, "sub"])
    dirs, files = m.count("dirs"), m.count("files")
    assert read(d / names[0]) == content(0)
    wait_until("the directory opened ahead", lambda: m.count("dirs") > dirs, timeout=20)
    assert m.count("files") - files == FILES - 1
    before = name_calls(mounted)
    for i, name in enumerate(names):
        assert read(d / name) == content(i)
    assert name_calls(mounted) == before


def test_a_mount_a_loader_hints_leaves_its_files_to_the_prefetcher(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    """While a loader hints its order, the prefetcher fetches the hinted
    files with no open: a lookup miss opens no directory ahead (counted
    `aside`), and the files still read whole."""
    b = mounts["H"]
    d = b.mountpoint / mnt.name
    dirs, aside = b.count("dirs"), b.count("aside")
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    os.setxattr(b.mountpoint, PREFETCH_XATTR, f"{mnt.name}/{names[3]}".encode())
    assert read(d / names[0]) == content(0)  # (a miss within HINTED_LATELY of the hint)
    wait_until("the miss counted aside", lambda: b.count("aside") > aside, timeout=20)
    assert b.count("dirs") == dirs
    for i, name in enumerate(names):
        assert read(d / name) == content(i)


def test_names_learned_ahead_follow_changes_made_on_another_mount(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    """The read-write mount's cache watch is told of each change before it
    returns on the other mount: a name renamed away, removed, rewritten or
    renamed over is seen at once, though the mount learned it from a listing."""
    b = mounts["B"]
    d = b.mountpoint / mnt.name
    assert first_miss(b, d, names[0]) == FILES - 1
    os.rename(mnt / names[5], mnt / "renamed")
    os.unlink(mnt / names[6])
    (mnt / names[7]).write_bytes(b"rewritten")
    (mnt / "other").write_bytes(b"renamed over")
    os.rename(mnt / "other", mnt / names[8])
    assert not (d / names[5]).exists()
    assert read(d / "renamed") == content(5)
    assert not (d / names[6]).exists()
    assert read(d / names[7]) == b"rewritten"
    assert read(d / names[8]) == b"renamed over"
    for i in range(9, FILES):
        assert read(d / names[i]) == content(i)


@pytest.mark.parametrize("mode", ["R", "I"])
def test_a_read_only_mount_keeps_a_learned_name_no_longer_than_entry_timeout(
    mounted: ProcessCluster,
    mounts: dict[str, MeteredMount],
    mnt: Path,
    names: list[str],
    mode: str,
) -> None:
    r = mounts[mode]
    d = r.mountpoint / mnt.name
    assert first_miss(r, d, names[0]) == FILES - 1
    os.stat(d)  # (its entry, if expired, is looked up before the count)
    before = name_calls(mounted)
    assert read(d / names[1]) == content(1)
    assert name_calls(mounted) == before
    os.unlink(mnt / names[2])
    # the old file, until the name is BOUND old
    wait_until("the removed name to go", lambda: not (d / names[2]).exists(), BOUND + SLACK)


def test_no_more_entries_than_dir_ahead_and_none_with_zero(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    e, n = mounts["E"], mounts["N"]
    # the first 8 files by name, less the one looked up (opened by its lookup)
    assert first_miss(e, e.mountpoint / mnt.name, names[0]) == 7
    for i, name in enumerate(names):
        assert read(e.mountpoint / mnt.name / name) == content(i)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    os.stat(n.mountpoint / mnt.name / names[0])
    before = name_calls(mounted)
    assert read(n.mountpoint / mnt.name / names[1]) == content(1)
    assert name_calls(mounted)["lookup_open"] > before["lookup_open"]
    assert n.count("dirs") == n.count("files") == 0


def test_files_whose_handles_are_held_already_are_learned_too(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    """A directory whose files the mount holds handles of already (opened
    through other names of them here: hard links; as a prefetch of hinted
    files holds them) learns their names all the same: its lookups ask
    nothing. (They were left out: a dataset's directories listed after a
    hinted epoch learned no name, and every lookup of the next epoch was a
    metadata call.)"""
    b = mounts["B"]
    (mnt / "links").mkdir()
    for name in names:
        os.link(mnt / name, mnt / "links" / name)
    d = b.mountpoint / mnt.name
    assert first_miss(b, d / "links", names[0]) == FILES - 1  # every inode's handle now held
    held = b.count("held")
    assert first_miss(b, d, names[0]) == 0  # none to open
    before = name_calls(mounted)
    for i, name in enumerate(names):
        assert read(d / name) == content(i)
    assert name_calls(mounted) == before
    assert b.count("held") - held == FILES  # names[0]'s lookup brought its own


def test_a_read_only_mount_lists_a_directory_again_once_its_names_aged_out(
    mounted: ProcessCluster, mounts: dict[str, MeteredMount], mnt: Path, names: list[str]
) -> None:
    """-o ro with entry_timeout shorter than handle_linger: once the names
    learned ahead are entry_timeout old, a miss lists the directory again
    and learns them anew from the handles still held (none reopened), so its
    lookups ask nothing once more (they all asked until the linger ended)."""
    r = mounts["R"]
    d = r.mountpoint / mnt.name
    assert first_miss(r, d, names[0]) == FILES - 1
    dirs, files, held = r.count("dirs"), r.count("files"), r.count("held")

    def listed_again() -> bool:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        os.stat(d / names[1])  # a miss once the names aged out
        return r.count("dirs") > dirs

    wait_until("a miss to list the directory again", listed_again, BOUND + SLACK)
    assert r.count("files") == files  # nothing reopened: the handles are held
    assert r.count("held") - held == FILES
    before = name_calls(mounted)
    for i in range(2, FILES):
        assert read(d / names[i]) == content(i)
    assert name_calls(mounted) == before
