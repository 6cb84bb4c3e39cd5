"""Close-to-open consistency between two mounts of one cluster.

What one mount wrote and closed, the other sees on its next open: new
content and new size, even when the size did not change, even when it had
just cached the file's attributes, and even when the name now leads to
another inode, and O_APPEND writes land at the end as it is now. A
hypothesis state machine then runs random open-act-close sequences through
either mount against one local directory. The second mount is started with
the real `shufflefs mount` and removed with `shufflefs umount`.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from clusters import ProcessCluster, another_mount
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)
from oscompare import digest, errname

CHUNK = 1 << 20


@pytest.fixture(scope="module")
def second(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with another_mount(mounted, tmp_path_factory.mktemp("second-mount")) as mountpoint:
        yield mountpoint


@pytest.fixture
def pair(mnt: Path, second: Path) -> tuple[Path, Path]:
    """The test's directory as seen through each mount."""
    other = second / mnt.name
    assert other.is_dir()
    return mnt, other


def read(p: Path) -> tuple[bytes, int]:
    """Content and size as one open sees them."""
    with open(p, "rb") as f:
        return f.read(), os.fstat(f.fileno()).st_size


def test_written_and_closed_is_seen_after_open(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"first")
    assert read(b / "f") == (b"first", 5)
    (a / "f").write_bytes(b"second, and longer")
    assert read(b / "f") == (b"second, and longer", 18)
    assert (b / "f").stat().st_size == 18
    (a / "f").write_bytes(b"short")
    assert read(b / "f") == (b"short", 5)


def test_rewrite_with_same_size(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"AAAA" * 1000)
    assert read(b / "f") == (b"AAAA" * 1000, 4000)  # b's page cache now holds the As
    fd = os.open(a / "f", os.O_WRONLY)
    try:
        os.pwrite(fd, b"BBBB" * 1000, 0)  # in place: no truncate, no size change
    finally:
        os.close(fd)
    assert read(b / "f") == (b"BBBB" * 1000, 4000)
    (a / "f").write_bytes(b"CCCC" * 1000)  # O_TRUNC and rewrite
    assert read(b / "f") == (b"CCCC" * 1000, 4000)


def test_reader_open_during_the_write_sees_it_on_reopen(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"x" * 10)
    with open(b / "f", "rb") as early:
        assert early.read() == b"x" * 10
        with open(a / "f", "r+b") as w:
            w.seek(0)
            w.write(b"y" * 20)
        assert read(b / "f") == (b"y" * 20, 20)


def test_extended_right_after_the_other_stat(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"1234")
    assert (b / "f").stat().st_size == 4  # b's kernel caches the attributes
    with open(a / "f", "ab") as f:
        f.write(b"5678")
    assert read(b / "f") == (b"12345678", 8)
    # and a file b has never opened, only listed
    (a / "g").write_bytes(b"ab")
    assert {e.name: e.stat().st_size for e in os.scandir(b)}["g"] == 2
    with open(a / "g", "ab") as f:
        f.write(b"cd")
    assert read(b / "g") == (b"abcd", 4)


def test_large_file_extended_across_chunks(pair: tuple[Path, Path]) -> None:
    a, b = pair
    first = os.urandom(3 << 19)  # 1.5 MiB
    (a / "big").write_bytes(first)
    assert read(b / "big") == (first, len(first))
    more = os.urandom(1 << 20)
    with open(a / "big", "ab") as f:
        f.write(more)
    assert read(b / "big") == (first + more, len(first) + len(more))


def test_new_and_removed_names(pair: tuple[Path, Path]) -> None:
    a, b = pair
    assert not (b / "n").exists()  # a negative lookup on b
    (a / "n").write_bytes(b"new")
    assert read(b / "n") == (b"new", 3)
    os.unlink(a / "n")
    with pytest.raises(FileNotFoundError):
        read(b / "n")
    assert "n" not in os.listdir(b)


def test_replaced_by_rename_is_seen_after_open(pair: tuple[Path, Path]) -> None:
    """The usual way to publish a file: write a temporary, rename it over."""
    a, b = pair
    (a / "data").write_bytes(b"old")
    assert read(b / "data") == (b"old", 3)  # b caches the name -> old inode
    (a / "data.tmp").write_bytes(b"new version")
    os.rename(a / "data.tmp", a / "data")  # the old inode is freed
    assert read(b / "data") == (b"new version", 11)
    assert (b / "data").stat().st_size == 11


def test_replaced_by_new_file_is_seen_after_open(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"one")
    assert read(b / "f") == (b"one", 3)
    os.unlink(a / "f")
    (a / "f").write_bytes(b"two!")
    assert read(b / "f") == (b"two!", 4)
    # b still caches the name of the removed file ("one" was opened through
    # it): a truncate by path cuts the file the name leads to now
    os.unlink(a / "f")
    (a / "f").write_bytes(b"three")
    os.truncate(b / "f", 2)
    assert read(a / "f") == (b"th", 2)
    assert read(b / "f") == (b"th", 2)


def test_metadata_changes_are_seen(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"x")
    assert (b / "f").stat().st_mode & 0o777 == 0o644
    os.mkdir(a / "d")
    os.rename(a / "f", a / "d" / "f")
    assert read(b / "d" / "f") == (b"x", 1)
    os.setxattr(a / "d" / "f", "user.k", b"v")
    assert os.getxattr(b / "d" / "f", "user.k") == b"v"


def append(p: Path, data: bytes) -> None:
    """open(O_APPEND), write, close: no fstat in between (Python's open() would
    make one, and so refresh the kernel's cached size by accident)."""
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def test_append_after_the_other_mount_changed_the_size(pair: tuple[Path, Path]) -> None:
    """O_APPEND writes at the end as it is now, not as this mount last saw it."""
    a, b = pair
    (a / "log").write_bytes(b"1234")
    assert read(b / "log") == (b"1234", 4)  # b's kernel caches size 4
    append(a / "log", b"5678")
    append(b / "log", b"ab")
    assert read(a / "log") == (b"12345678ab", 10)
    os.truncate(a / "log", 2)  # and after a shrink
    append(b / "log", b"cd")
    assert read(a / "log") == (b"12cd", 4)
    for i in range(6):  # taking turns
        append((a, b)[i % 2] / "log", b"%d" % i)
    assert read(b / "log") == (b"12cd012345", 10)
    assert read(a / "log") == (b"12cd012345", 10)


def test_seek_to_end_after_the_other_mount_extended(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (a / "f").write_bytes(b"1234")
    assert (b / "f").stat().st_size == 4
    append(a / "f", b"5678")
    fd = os.open(b / "f", os.O_RDWR)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == 8
        os.write(fd, b"9")
    finally:
        os.close(fd)
    assert read(a / "f") == (b"123456789", 9)


def test_fsync_publishes_the_length_without_close(pair: tuple[Path, Path]) -> None:
    a, b = pair
    fd = os.open(a / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"synced")
        os.fsync(fd)
        assert read(b / "f") == (b"synced", 6)
        os.write(fd, b" and more")
        os.fdatasync(fd)
        assert read(b / "f") == (b"synced and more", 15)
    finally:
        os.close(fd)


# ---- random sequences across both mounts ---------------------------------------

FILES = ["f", "g"]
files = st.sampled_from(FILES)
vias = st.integers(0, 1)
offsets = st.one_of(st.integers(0, 2 * CHUNK), st.sampled_from([0, CHUNK - 1, CHUNK]))
sizes = st.one_of(st.integers(0, 3000), st.integers(0, CHUNK + 100))


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError as exc:
        return errname(exc)


def write_at(p: Path, data: bytes, offset: int, flags: int) -> int:
    fd = os.open(p, os.O_WRONLY | flags, 0o644)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def open_and_read(p: Path, offset: int, size: int) -> tuple[int, str]:
    """What one open shows: the size, and the digest of a range."""
    fd = os.open(p, os.O_RDONLY)
    try:
        return os.fstat(fd).st_size, digest(os.pread(fd, size, offset))
    finally:
        os.close(fd)


def create_with(name: str, data: bytes, d: Path) -> int:
    return write_at(d / name, data, 0, os.O_CREAT)


def final_state(name: str, d: Path) -> tuple[int, str]:
    return open_and_read(d / name, 0, 4 * CHUNK)


class TwoMountsVersusLocal(RuleBasedStateMachine):
    """Every step opens, acts and closes through one of the two mounts (picked
    at random); close-to-open says the other mount's next open sees the
    result, so each step must give what the same step gives locally."""

    bases: ClassVar[tuple[Path, Path, Path]]  # local, mount a, mount b (same directory)
    counter: ClassVar[itertools.count[int]]

    def __init__(self) -> None:
        super().__init__()
        name = f"ex{next(self.counter)}"
        local, a, b = (base / name for base in self.bases)
        local.mkdir()
        a.mkdir()
        self.local = local
        self.mounts = (a, b)

    @initialize(size=sizes, seed=st.integers(0, 1 << 32))
    def populate(self, size: int, seed: int) -> None:
        for i, name in enumerate(FILES):
            data = random.Random(seed + i).randbytes(size)
            create = functools.partial(create_with, name, data)
            self.both(f"create {name}", i % 2, create)

    def both(self, what: str, via: int, fn: Callable[[Path], Any]) -> None:
        mount = outcome(functools.partial(fn, self.mounts[via]))
        local = outcome(functools.partial(fn, self.local))
        assert mount == local, f"{what} via {'ab'[via]}: mount {mount!r}, local {local!r}"

    @rule(
        name=files,
        via=vias,
        offset=offsets,
        size=sizes,
        seed=st.integers(0, 1 << 32),
        trunc=st.booleans(),
    )
    def write(self, name: str, via: int, offset: int, size: int, seed: int, trunc: bool) -> None:
        data = random.Random(seed).randbytes(size)
        flags = os.O_CREAT | (os.O_TRUNC if trunc else 0)
        self.both(f"write {name}", via, lambda d: write_at(d / name, data, offset, flags))

    @rule(name=files, via=vias, size=sizes, seed=st.integers(0, 1 << 32))
    def append(self, name: str, via: int, size: int, seed: int) -> None:
        data = random.Random(seed).randbytes(size)
        flags = os.O_APPEND | os.O_CREAT
        self.both(f"append {name}", via, lambda d: write_at(d / name, data, 0, flags))

    @rule(name=files, via=vias, size=st.integers(0, 2 * CHUNK))
    def truncate(self, name: str, via: int, size: int) -> None:
        self.both(f"truncate {name}", via, lambda d: os.truncate(d / name, size))

    @rule(name=files, via=vias, other=vias, size=sizes, seed=st.integers(0, 1 << 32))
    def replace(self, name: str, via: int, other: int, size: int, seed: int) -> None:
        """Unlink through one mount, create anew through either."""
        data = random.Random(seed).randbytes(size)
        self.both(f"unlink {name}", via, lambda d: os.unlink(d / name))
        self.both(f"recreate {name}", other, lambda d: write_at(d / name, data, 0, os.O_CREAT))

    @rule(name=files, via=vias, offset=offsets, size=sizes)
    def read(self, name: str, via: int, offset: int, size: int) -> None:
        self.both(f"read {name}", via, lambda d: open_and_read(d / name, offset, size))

    @rule(via=vias)
    def listdir(self, via: int) -> None:
        self.both("listdir", via, lambda d: sorted(os.listdir(d)))

    def teardown(self) -> None:
        for name in FILES:
            for via in (0, 1):
                self.both(f"final {name}", via, functools.partial(final_state, name))


def test_two_mounts_behave_like_one_local_fs(pair: tuple[Path, Path], tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()

    class Machine(TwoMountsVersusLocal):
        bases = (local, *pair)
        counter = itertools.count()

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )


def test_a_name_removed_elsewhere_is_gone_while_the_kernel_still_caches_it(
    mounted: ProcessCluster, mnt: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A mount whose kernel keeps a name (entry_timeout) of a file another
    mount then removes, while that other mount keeps the file open (so the
    inode lives on, unnamed): a stat of the name is ENOENT, not the removed
    file with nlink 0 (its GETATTR answers ESTALE and the kernel looks the
    name up again); the holder's fstat still works."""
    where = tmp_path_factory.mktemp("long-names")
    with another_mount(mounted, where, "no_cache_watch,entry_timeout=60,attr_timeout=0") as m:
        a, b = mnt, m / mnt.name
        (a / "kept").write_bytes(b"still open")
        assert (b / "kept").stat().st_size == 10  # the kernel keeps the name 60 s
        fd = os.open(a / "kept", os.O_RDONLY)
        try:
            os.unlink(a / "kept")
            assert not (b / "kept").exists()
            with pytest.raises(FileNotFoundError):
                os.stat(b / "kept")
            assert os.fstat(fd).st_nlink == 0
            assert os.pread(fd, 100, 0) == b"still open"
        finally:
            os.close(fd)
        # a file this mount holds open itself keeps its attributes, unnamed
        (b / "mine").write_bytes(b"mine")
        with open(b / "mine", "rb") as f:
            os.unlink(a / "mine")
            assert os.fstat(f.fileno()).st_nlink == 0
            assert f.read() == b"mine"
