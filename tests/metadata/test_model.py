"""The store against a plain in-memory model of a directory tree.

Hypothesis drives random sequences of mkdir, mknod, symlink, link, unlink,
rmdir, rename (all flags), open and release; each result (or errno) must be
what the model predicts, and after every step the store's listing, link
counts and parent pointers must match the model and fsck() must be clean.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shufflefs.metadata.protocol import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, Layout
from shufflefs.metadata.store import NamespaceStore
from shufflefs.rpc.errors import FsError

ROOT = ROOT_INODE
NAMES = [b"a", b"b", b"c", b"d"]
names = st.sampled_from(NAMES)
picks = st.integers(min_value=0, max_value=1 << 16)


def layout() -> Layout:
    return {"chunk_size": 4096, "chains": [7]}


class NamespaceModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="shufflefs-model-")
        self.ns = NamespaceStore(Path(self.tmp) / "ns", map_size=32 << 20, sync=False)
        self.session = self.ns.session_open("model", "host", 1)["session"]
        self.entries: dict[int, dict[bytes, int]] = {ROOT: {}}  # live directories
        self.kind: dict[int, str] = {ROOT: "dir"}  # every live inode: dir, file, link
        self.handles: dict[int, list[int]] = {}
        self.freed: set[int] = set()

    def teardown(self) -> None:
        self.ns.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- the model ------------------------------------------------------------

    def links(self, ino: int) -> int:
        return sum(1 for entries in self.entries.values() for v in entries.values() if v == ino)

    def parent_of(self, ino: int) -> int:
        if ino == ROOT:
            return ROOT
        return next(p for p, entries in self.entries.items() if ino in entries.values())

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT:
                return False
            ino = self.parent_of(ino)

    def maybe_free(self, ino: int) -> None:
        if self.kind[ino] == "dir":
            if not any(ino in e.values() for e in self.entries.values()):
                del self.entries[ino]
                del self.kind[ino]
                self.freed.add(ino)
            return
        if self.links(ino) == 0 and not self.handles.get(ino):
            kind = self.kind.pop(ino)
            self.freed.add(ino)
            if kind == "file":
                jobs = [j["ino"] for j in self.ns.gc_jobs()]
                assert ino in jobs, "a freed file must leave a gc job"
                self.ns.gc_done(ino)

    def pick(self, pool: list[int], i: int) -> int:
        return sorted(pool)[i % len(pool)]

    def pick_parent(self, i: int) -> int:
        """Mostly a directory; sometimes a file, to provoke ENOTDIR."""
        files = [ino for ino, kind in self.kind.items() if kind != "dir"]
        if i % 9 == 8 and files:
            return self.pick(files, i // 9)
        return self.pick(list(self.entries), i)

    def pick_entry(self, i: int, name: bytes) -> tuple[int, bytes]:
        """Mostly an existing (directory, name); sometimes anything."""
        pairs = sorted((p, n) for p, entries in self.entries.items() for n in entries)
        if pairs and i % 6 != 5:
            return pairs[i % len(pairs)]
        return self.pick_parent(i), name

    def expect(self, expected: int | None, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except FsError as exc:
            assert exc.code == expected, f"got {errno.errorcode[exc.code]}, expected {expected}"
            return None
        assert expected is None, f"succeeded, expected {errno.errorcode[expected]}"
        return result

    def new_name_errno(self, parent: int, name: bytes) -> int | None:
        if parent not in self.entries:
            return errno.ENOTDIR
        if name in self.entries[parent]:
            return errno.EEXIST
        return None

    def add(self, parent: int, name: bytes, attr: dict[str, Any], kind: str) -> None:
        ino = attr["ino"]
        assert ino not in self.kind and ino not in self.freed, "inode numbers are never reused"
        self.kind[ino] = kind
        self.entries[parent][name] = ino
        if kind == "dir":
            self.entries[ino] = {}

    # ---- rules -----------------------------------------------------------------

    @initialize()
    def base_tree(self) -> None:
        """Start from a few nested directories, so that short runs already
        move things between directories and up and down the tree."""
        a = self.ns.mkdir(ROOT, b"a", 0o755, 0, 0)
        self.add(ROOT, b"a", a, "dir")
        b = self.ns.mkdir(ROOT, b"b", 0o755, 0, 0)
        self.add(ROOT, b"b", b, "dir")
        c = self.ns.mkdir(a["ino"], b"c", 0o755, 0, 0)
        self.add(a["ino"], b"c", c, "dir")
        for parent, name in ((b["ino"], b"a"), (c["ino"], b"b")):
            f = self.ns.mknod(parent, name, stat.S_IFREG | 0o644, 0, 0, 0, layout)
            self.add(parent, name, f, "file")

    @rule(p=picks, name=names)
    def mkdir(self, p: int, name: bytes) -> None:
        parent = self.pick_parent(p)
        expected = self.new_name_errno(parent, name)
        attr = self.expect(expected, lambda: self.ns.mkdir(parent, name, 0o755, 1, 1))
        if attr is not None:
            self.add(parent, name, attr, "dir")

    @rule(p=picks, name=names)
    def mknod(self, p: int, name: bytes) -> None:
        parent = self.pick_parent(p)
        expected = self.new_name_errno(parent, name)
        attr = self.expect(
            expected, lambda: self.ns.mknod(parent, name, stat.S_IFREG | 0o644, 0, 1, 1, layout)
        )
        if attr is not None:
            self.add(parent, name, attr, "file")

    @rule(p=picks, name=names, dest=names)
    def symlink(self, p: int, name: bytes, dest: bytes) -> None:
        parent = self.pick_parent(p)
        expected = self.new_name_errno(parent, name)
        attr = self.expect(expected, lambda: self.ns.symlink(parent, name, dest, 1, 1))
        if attr is not None:
            self.add(parent, name, attr, "link")

    @rule(s=picks, p=picks, name=names)
    def link(self, s: int, p: int, name: bytes) -> None:
        others = [ino for ino, kind in self.kind.items() if kind != "dir"]
        src = self.pick(others if others and s % 5 else list(self.kind), s)
        parent = self.pick_parent(p)
        expected = self.new_name_errno(parent, name)
        if expected is None and self.kind[src] == "dir":
            expected = errno.EPERM
        if expected is None and self.links(src) == 0:
            expected = errno.ENOENT
        if self.expect(expected, lambda: self.ns.link(src, parent, name)) is not None:
            self.entries[parent][name] = src

    @rule(p=picks, name=names)
    def unlink(self, p: int, name: bytes) -> None:
        parent, name = self.pick_entry(p, name)
        child = self.entries.get(parent, {}).get(name)
        if parent not in self.entries:
            expected: int | None = errno.ENOTDIR
        elif child is None:
            expected = errno.ENOENT
        elif self.kind[child] == "dir":
            expected = errno.EISDIR
        else:
            expected = None
        self.expect(expected, lambda: self.ns.unlink(parent, name))
        if expected is None and child is not None:
            del self.entries[parent][name]
            self.maybe_free(child)

    @rule(p=picks, name=names)
    def rmdir(self, p: int, name: bytes) -> None:
        parent, name = self.pick_entry(p, name)
        child = self.entries.get(parent, {}).get(name)
        if parent not in self.entries:
            expected: int | None = errno.ENOTDIR
        elif child is None:
            expected = errno.ENOENT
        elif self.kind[child] != "dir":
            expected = errno.ENOTDIR
        elif self.entries[child]:
            expected = errno.ENOTEMPTY
        else:
            expected = None
        self.expect(expected, lambda: self.ns.rmdir(parent, name))
        if expected is None and child is not None:
            del self.entries[parent][name]
            self.maybe_free(child)

    @rule(
        p=picks,
        name=names,
        np=picks,
        new_name=names,
        flags=st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]),
    )
    def rename(self, p: int, name: bytes, np: int, new_name: bytes, flags: int) -> None:
        parent, name = self.pick_entry(p, name)
        new_parent = self.pick_parent(np)
        if flags & RENAME_EXCHANGE or np % 3 == 0:
            new_parent, new_name = self.pick_entry(np, new_name)
        src = self.entries.get(parent, {}).get(name)
        twins = [(p, n) for p, e in self.entries.items() for n, i in e.items() if i == src]
        if np % 3 == 1 and len(twins) > 1:  # onto another name of the same inode
            new_parent, new_name = twins[np % len(twins)]
        expected = self.rename_errno(parent, name, new_parent, new_name, flags)
        self.expect(expected, lambda: self.ns.rename(parent, name, new_parent, new_name, flags))
        if expected is not None:
            return
        src = self.entries[parent][name]
        dst = self.entries[new_parent].get(new_name)
        if src == dst:
            return
        if flags & RENAME_EXCHANGE:
            assert dst is not None
            self.entries[parent][name], self.entries[new_parent][new_name] = dst, src
            return
        del self.entries[parent][name]
        self.entries[new_parent][new_name] = src
        if dst is not None:
            self.maybe_free(dst)

    def rename_errno(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int
    ) -> int | None:
        if parent not in self.entries or new_parent not in self.entries:
            return errno.ENOTDIR
        src = self.entries[parent].get(name)
        if src is None:
            return errno.ENOENT
        dst = self.entries[new_parent].get(new_name)
        exchange = bool(flags & RENAME_EXCHANGE)
        if dst is None and exchange:
            return errno.ENOENT
        if dst is not None and flags & RENAME_NOREPLACE:
            return errno.EEXIST
        if parent != new_parent:
            if self.kind[src] == "dir" and self.is_ancestor(src, new_parent):
                return errno.EINVAL
            if dst is not None and self.kind[dst] == "dir" and self.is_ancestor(dst, parent):
                return errno.EINVAL if exchange else errno.ENOTEMPTY
        if src == dst or exchange or dst is None:
            return None
        if self.kind[src] == "dir":
            if self.kind[dst] != "dir":
                return errno.ENOTDIR
            if self.entries[dst]:
                return errno.ENOTEMPTY
        elif self.kind[dst] == "dir":
            return errno.EISDIR
        return None

    @rule(f=picks)
    def open(self, f: int) -> None:
        files = [ino for ino, kind in self.kind.items() if kind == "file"]
        if not files:
            return
        ino = self.pick(files, f)
        result = self.ns.open(ino, os.O_RDWR, self.session)
        assert result["layout"] == layout()
        self.handles.setdefault(ino, []).append(result["handle"])

    @rule(h=picks)
    def release(self, h: int) -> None:
        held = [ino for ino, handles in self.handles.items() if handles]
        if not held:
            return
        ino = self.pick(held, h)
        handle = self.handles[ino].pop()
        freed = self.ns.release(ino, handle, self.session)
        assert freed == (self.links(ino) == 0 and not self.handles[ino])
        self.maybe_free(ino)

    # ---- checks ----------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        for ino, kind in self.kind.items():
            attr = self.ns.getattr(ino)
            if kind == "dir":
                subdirs = sum(1 for c in self.entries[ino].values() if self.kind[c] == "dir")
                assert attr["nlink"] == 2 + subdirs
                assert attr["parent"] == self.parent_of(ino)
                page = self.ns.readdir(ino, None, 100)
                listed = {name: a["ino"] for name, a in page["entries"]}
                assert listed == self.entries[ino]
            else:
                assert attr["nlink"] == self.links(ino)
        for ino in self.freed:
            try:
                self.ns.getattr(ino)
            except FsError as exc:
                assert exc.code == errno.ENOENT
            else:
                raise AssertionError(f"freed inode {ino} still exists")

    @invariant()
    def consistent(self) -> None:
        assert self.ns.fsck() == []


NamespaceModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_namespace_model = NamespaceModel.TestCase
