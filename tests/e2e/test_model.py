"""The mount against Linux itself, driven by random operation sequences.

Hypothesis runs the same sequence of operations on a local directory (ext4)
and on the mount; every step's result (or errno) must be the same on both,
and after every step the two trees must list the same names with the same
type, permission bits, size and link count. File contents are written at
random offsets and sizes up to a few MiB, across chunk boundaries (1 MiB),
through short-lived opens and through descriptors kept open across steps
(so lengths not yet reported to the metadata server are checked too).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from oscompare import digest, errname, stat_summary

CHUNK = 1 << 20
# few enough names that most operations meet something that exists
PATHS = ["a", "b", "d", "d/a", "d/b", "d/d", "d/d/a", "e", "e/a"]
SYMLINK_TARGETS = ["a", "d", "../a", "d/a", "missing", "d/d"]
XATTR_NAMES = ["user.a", "user.b"]
MAX_OPEN = 4

paths = st.sampled_from(PATHS)
offsets = st.one_of(
    st.integers(0, 3 * CHUNK),
    st.sampled_from([0, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 3]),
)
sizes = st.one_of(st.integers(0, 5000), st.integers(0, 3 * CHUNK // 2))
modes = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o444, 0o000, 0o4755, 0o1777])
seeds = st.integers(0, 1 << 32)
slots = st.integers(0, MAX_OPEN - 1)


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError as exc:
        return errname(exc)


class MountVersusLocal(RuleBasedStateMachine):
    """Subclassed per test run with `bases` = (local dir, mount dir)."""

    bases: ClassVar[tuple[Path, Path]]
    counter: ClassVar[itertools.count[int]]

    def __init__(self) -> None:
        super().__init__()
        n = next(self.counter)
        self.roots = tuple(base / f"ex{n}" for base in self.bases)
        for root in self.roots:
            root.mkdir()
        self.fds: list[tuple[int, int] | None] = [None] * MAX_OPEN

    def both(self, what: str, fn: Callable[[Path], Any]) -> Any:
        """Run *fn* on both roots; the outcomes (value or errno) must be equal."""
        local, mount = (outcome(functools.partial(fn, root)) for root in self.roots)
        assert mount == local, f"{what}: mount gave {mount!r}, local gave {local!r}"
        return mount

    def both_fd(self, what: str, slot: int, fn: Callable[[int], Any]) -> None:
        pair = self.fds[slot]
        if pair is None:
            return
        local, mount = (outcome(functools.partial(fn, fd)) for fd in pair)
        assert mount == local, f"{what}: mount gave {mount!r}, local gave {local!r}"

    @initialize(a=sizes, da=sizes, seed=seeds)
    def populate(self, a: int, da: int, seed: int) -> None:
        """Start from a small tree: directories d and d/d, files a and d/a."""
        for root in self.roots:
            (root / "d" / "d").mkdir(parents=True)
            (root / "a").write_bytes(payload(seed, a))
            (root / "d" / "a").write_bytes(payload(seed + 1, da))

    # ---- namespace -------------------------------------------------------------

    @rule(path=paths, mode=modes)
    def mkdir(self, path: str, mode: int) -> None:
        self.both(f"mkdir {path}", lambda r: os.mkdir(r / path, mode))

    @rule(path=paths)
    def rmdir(self, path: str) -> None:
        self.both(f"rmdir {path}", lambda r: os.rmdir(r / path))

    @rule(path=paths)
    def unlink(self, path: str) -> None:
        self.both(f"unlink {path}", lambda r: os.unlink(r / path))

    @rule(src=paths, dst=paths)
    def rename(self, src: str, dst: str) -> None:
        self.both(f"rename {src} {dst}", lambda r: os.rename(r / src, r / dst))

    @rule(src=paths, dst=paths)
    def link(self, src: str, dst: str) -> None:
        self.both(f"link {src} {dst}", lambda r: os.link(r / src, r / dst, follow_symlinks=False))

    @rule(to=st.sampled_from(SYMLINK_TARGETS), path=paths)
    def symlink(self, to: str, path: str) -> None:
        self.both(f"symlink {to} {path}", lambda r: os.symlink(to, r / path))

    @rule(path=paths)
    def readlink(self, path: str) -> None:
        self.both(f"readlink {path}", lambda r: os.readlink(r / path))

    @rule(path=paths, mode=modes)
    def chmod(self, path: str, mode: int) -> None:
        self.both(f"chmod {path} {mode:o}", lambda r: os.chmod(r / path, mode))

    @rule(path=paths)
    def listdir(self, path: str) -> None:
        self.both(f"listdir {path}", lambda r: sorted(os.listdir(r / path)))

    @rule(path=paths, follow=st.booleans())
    def stat_path(self, path: str, follow: bool) -> None:
        self.both(
            f"stat {path}",
            lambda r: stat_summary(os.stat(r / path, follow_symlinks=follow)),
        )

    # ---- file contents -----------------------------------------------------------

    @rule(
        path=paths,
        offset=offsets,
        size=sizes,
        seed=seeds,
        how=st.sampled_from(["create", "trunc", "append", "existing", "excl"]),
        mode=modes,
    )
    def write(self, path: str, offset: int, size: int, seed: int, how: str, mode: int) -> None:
        flags = (
            os.O_WRONLY
            | {
                "create": os.O_CREAT,
                "trunc": os.O_CREAT | os.O_TRUNC,
                "append": os.O_CREAT | os.O_APPEND,
                "existing": 0,
                "excl": os.O_CREAT | os.O_EXCL,
            }[how]
        )
        data = payload(seed, size)

        def op(r: Path) -> int:
            fd = os.open(r / path, flags, mode)
            try:
                return os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        self.both(f"write {path} {how} at {offset} +{size}", op)

    @rule(path=paths, offset=offsets, size=sizes)
    def read(self, path: str, offset: int, size: int) -> None:
        def op(r: Path) -> str:
            fd = os.open(r / path, os.O_RDONLY)
            try:
                return digest(os.pread(fd, size, offset))
            finally:
                os.close(fd)

        self.both(f"read {path} at {offset} +{size}", op)

    @rule(path=paths, size=st.one_of(st.integers(0, 4 * CHUNK), st.integers(0, 3000)))
    def truncate(self, path: str, size: int) -> None:
        self.both(f"truncate {path} {size}", lambda r: os.truncate(r / path, size))

    # ---- descriptors kept open across steps ----------------------------------------

    @rule(
        slot=slots,
        path=paths,
        how=st.sampled_from(
            [os.O_RDWR, os.O_RDONLY, os.O_RDWR | os.O_APPEND, os.O_RDWR | os.O_CREAT]
        ),
    )
    def open_fd(self, slot: int, path: str, how: int) -> None:
        self.close_fd(slot)
        pair = tuple(outcome(functools.partial(os.open, r / path, how, 0o644)) for r in self.roots)
        local_ok, mount_ok = (isinstance(x, int) for x in pair)
        if local_ok and mount_ok:
            self.fds[slot] = (pair[0], pair[1])
            return
        for x in pair:
            if isinstance(x, int):
                os.close(x)
        assert pair[1] == pair[0], f"open {path} {how:o}: mount {pair[1]!r}, local {pair[0]!r}"

    @rule(slot=slots)
    def close_fd(self, slot: int) -> None:
        pair = self.fds[slot]
        if pair is not None:
            self.fds[slot] = None
            for fd in pair:
                os.close(fd)

    @rule(slot=slots, offset=offsets, size=sizes, seed=seeds)
    def fd_write(self, slot: int, offset: int, size: int, seed: int) -> None:
        data = payload(seed, size)
        self.both_fd(f"pwrite fd {slot}", slot, lambda fd: os.pwrite(fd, data, offset))

    @rule(slot=slots, offset=offsets, size=sizes)
    def fd_read(self, slot: int, offset: int, size: int) -> None:
        self.both_fd(f"pread fd {slot}", slot, lambda fd: digest(os.pread(fd, size, offset)))

    @rule(slot=slots, size=st.integers(0, 3 * CHUNK))
    def fd_truncate(self, slot: int, size: int) -> None:
        self.both_fd(f"ftruncate fd {slot}", slot, lambda fd: os.ftruncate(fd, size))

    @rule(slot=slots)
    def fd_stat(self, slot: int) -> None:
        self.both_fd(f"fstat fd {slot}", slot, lambda fd: stat_summary(os.fstat(fd)))

    # ---- extended attributes ----------------------------------------------------

    @rule(
        path=paths,
        name=st.sampled_from(XATTR_NAMES),
        value=st.binary(max_size=64),
        flags=st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE]),
    )
    def setxattr(self, path: str, name: str, value: bytes, flags: int) -> None:
        self.both(f"setxattr {path} {name}", lambda r: os.setxattr(r / path, name, value, flags))

    @rule(path=paths, name=st.sampled_from(XATTR_NAMES))
    def getxattr(self, path: str, name: str) -> None:
        self.both(f"getxattr {path} {name}", lambda r: os.getxattr(r / path, name))

    @rule(path=paths, name=st.sampled_from(XATTR_NAMES))
    def removexattr(self, path: str, name: str) -> None:
        self.both(f"removexattr {path} {name}", lambda r: os.removexattr(r / path, name))

    @rule(path=paths)
    def listxattr(self, path: str) -> None:
        self.both(f"listxattr {path}", lambda r: sorted(os.listxattr(r / path)))

    # ---- after every step ----------------------------------------------------------

    def tree(self, root: Path, contents: bool) -> dict[str, Any]:
        """Every name under *root*: its lstat summary (and file digest)."""
        out: dict[str, Any] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                st = os.lstat(p)
                entry: Any = stat_summary(st)
                if contents and stat.S_ISREG(st.st_mode):
                    entry = (entry, digest(p.read_bytes()))
                out[str(p.relative_to(root))] = entry
        return out

    @invariant()
    def same_tree(self) -> None:
        local, mount = (self.tree(r, contents=False) for r in self.roots)
        assert mount == local

    def teardown(self) -> None:
        for slot in range(MAX_OPEN):
            self.close_fd(slot)
        local, mount = (self.tree(r, contents=True) for r in self.roots)
        assert mount == local


def test_mount_behaves_like_local_fs(writable_mnt: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()

    class Machine(MountVersusLocal):
        bases = (local, writable_mnt)
        counter = itertools.count()

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
