"""The namespace's consistency check: every invariant the store maintains,
verified on one read snapshot. The tests run it after every step; an operator
can run it on a live server's namespace (it never blocks the writer)."""

from __future__ import annotations

import errno
from collections import Counter, defaultdict
from collections.abc import Iterator

from shufflefs.metadata.checks import DOTS, check_name
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.records import (
    C_HANDLE,
    C_INO,
    C_JOB,
    C_SESSION,
    DB_COUNTERS,
    DB_DENTRIES,
    DB_GC,
    DB_HANDLES,
    DB_INODES,
    DB_SESSION_HANDLES,
    DB_SESSIONS,
    DB_TRUNCATES,
    DB_XATTRS,
    DENTRY_VALUE,
    U64,
    Rec,
    file_type,
    is_dir,
    is_lnk,
    is_reg,
    unpack,
)
from shufflefs.metadata.txn import Tx
from shufflefs.rpc.errors import FsError


class Fsck:
    """Collects problems instead of stopping at the first: a damaged
    namespace is easier to repair from the whole list."""

    def __init__(self, tx: Tx, read_only: set[int] | None = None, grace: bool = False) -> None:
        """*read_only*: the inodes held by in-memory read-only handles;
        *grace*: a restart's grace lasts, so an inode with no name may be
        held by a handle not yet re-reported."""
        self.tx = tx
        self.read_only = read_only or set()
        self.grace = grace
        self.problems: list[str] = []

    def items(self, db: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self.tx.prefix_items(db, b"")

    def bad(self, message: str) -> None:
        self.problems.append(message)

    def run(self) -> list[str]:
        counters = {k: int(U64.unpack(v)[0]) for k, v in self.items(DB_COUNTERS)}
        inodes = self.check_inodes()
        if ROOT_INODE not in inodes:
            self.bad("root inode missing")
        links, subdirs, dir_parents, children = self.check_dentries(inodes)
        handles = self.check_handles(inodes)
        held = handles.copy()  # by a durable handle or a read-only one in memory
        held.update(ino for ino in inodes if ino in self.read_only or self.grace)
        self.check_links(inodes, links, subdirs, dir_parents, held)
        self.check_reachable(inodes, children, held)
        self.check_jobs(inodes)
        for key, _ in self.items(DB_XATTRS):
            ino = U64.unpack(key[:8])[0]
            if ino not in inodes:
                self.bad(f"xattr {key[8:]!r} of missing inode {ino}")
        self.check_counters(counters, inodes, handles)
        return self.problems

    def check_inodes(self) -> dict[int, Rec]:
        inodes: dict[int, Rec] = {}
        fields = ("mode", "nlink", "uid", "gid", "rdev", "size", "atime", "mtime", "ctime")
        for key, raw in self.items(DB_INODES):
            ino = int(U64.unpack(key)[0])
            try:
                rec = unpack(raw)
                missing = [f for f in (*fields, "parent") if f not in rec]
            except Exception as exc:
                self.bad(f"inode {ino}: undecodable record ({type(exc).__name__})")
                continue
            if missing:
                self.bad(f"inode {ino}: missing fields {missing}")
                continue
            inodes[ino] = rec
            if is_reg(rec):
                layout = rec.get("layout")
                if (
                    not isinstance(layout, dict)
                    or not layout.get("chains")
                    or layout.get("chunk_size", 0) <= 0
                ):
                    self.bad(f"inode {ino}: regular file without a valid layout")
                if rec["size"] < 0:
                    self.bad(f"inode {ino}: negative size")
            elif is_lnk(rec):
                target = rec.get("target")
                if not isinstance(target, bytes) or rec["size"] != len(target):
                    self.bad(f"inode {ino}: symlink target missing or size mismatch")
        return inodes

    def check_dentries(
        self, inodes: dict[int, Rec]
    ) -> tuple[Counter[int], Counter[int], dict[int, list[int]], dict[int, list[int]]]:
        links: Counter[int] = Counter()
        subdirs: Counter[int] = Counter()
        dir_parents: dict[int, list[int]] = defaultdict(list)
        children: dict[int, list[int]] = defaultdict(list)
        for key, value in self.items(DB_DENTRIES):
            parent = int(U64.unpack(key[:8])[0])
            name = key[8:]
            child, ftype = DENTRY_VALUE.unpack(value)
            try:
                check_name(name)
                if name in DOTS:
                    raise FsError(errno.EINVAL, "dot name")
            except FsError:
                self.bad(f"dentry {name[:64]!r} in {parent}: invalid name")
            prec = inodes.get(parent)
            if prec is None:
                self.bad(f"dentry {name!r} in missing directory {parent}")
            elif not is_dir(prec):
                self.bad(f"dentry {name!r} in non-directory {parent}")
            elif prec["nlink"] == 0:
                self.bad(f"dentry {name!r} in removed directory {parent}")
            crec = inodes.get(child)
            if crec is None:
                self.bad(f"dentry {name!r} in {parent} points to missing inode {child}")
                continue
            if ftype != file_type(crec["mode"]):
                self.bad(f"dentry {name!r} in {parent}: file type {ftype} != inode's")
            links[child] += 1
            children[parent].append(child)
            if is_dir(crec):
                subdirs[parent] += 1
                dir_parents[child].append(parent)
        return links, subdirs, dir_parents, children

    def check_handles(self, inodes: dict[int, Rec]) -> Counter[int]:
        handles: Counter[int] = Counter()
        sessions = {int(U64.unpack(k)[0]) for k, _ in self.items(DB_SESSIONS)}
        by_session = {(k[:8], k[8:]): v for k, v in self.items(DB_SESSION_HANDLES)}
        seen = set()
        for key, value in self.items(DB_HANDLES):
            ino, handle = U64.unpack(key[:8])[0], U64.unpack(key[8:])[0]
            session = U64.unpack(value)[0]
            handles[ino] += 1
            if ino not in inodes:
                self.bad(f"handle {handle} of missing inode {ino}")
            if session not in sessions:
                self.bad(f"handle {handle} of missing session {session}")
            if by_session.get((value, key[8:])) != key[:8]:
                self.bad(f"handle {handle} missing from its session's index")
            seen.add((value, key[8:]))
        for extra in set(by_session) - seen:
            self.bad(f"session index names unknown handle {U64.unpack(extra[1])[0]}")
        return handles

    def check_links(
        self,
        inodes: dict[int, Rec],
        links: Counter[int],
        subdirs: Counter[int],
        dir_parents: dict[int, list[int]],
        handles: Counter[int],
    ) -> None:
        for ino, rec in inodes.items():
            if is_dir(rec):
                names = dir_parents.get(ino, [])
                if ino == ROOT_INODE:
                    if names:
                        self.bad("root has a name in some directory")
                    if rec["parent"] != ROOT_INODE:
                        self.bad(f"root's parent is {rec['parent']}")
                elif len(names) > 1:
                    self.bad(f"directory {ino} has {len(names)} names")
                elif names and rec["parent"] != names[0]:
                    self.bad(f"directory {ino}: parent {rec['parent']} but named in {names[0]}")
                removed = ino != ROOT_INODE and not names
                expected = 0 if removed else 2 + subdirs[ino]
                if rec["nlink"] != expected:
                    self.bad(f"directory {ino}: nlink {rec['nlink']}, expected {expected}")
                if removed and subdirs[ino]:
                    self.bad(f"removed directory {ino} has entries")
            elif rec["nlink"] != links[ino]:
                self.bad(f"inode {ino}: nlink {rec['nlink']} but {links[ino]} names")
            if rec["nlink"] == 0 and not handles[ino]:
                self.bad(f"inode {ino}: no name and no open handle (leaked)")

    def check_reachable(
        self, inodes: dict[int, Rec], children: dict[int, list[int]], handles: Counter[int]
    ) -> None:
        reachable = {ROOT_INODE}
        todo = [ROOT_INODE]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in reachable and child in inodes:
                    reachable.add(child)
                    if is_dir(inodes[child]):
                        todo.append(child)
        for ino in inodes:
            if ino not in reachable and not handles[ino]:
                self.bad(f"inode {ino} is unreachable from the root")
            elif ino not in reachable and inodes[ino]["nlink"] > 0:
                self.bad(f"inode {ino} has names but is unreachable from the root")

    def check_jobs(self, inodes: dict[int, Rec]) -> None:
        for key, raw in self.items(DB_GC):
            ino = U64.unpack(key)[0]
            if ino in inodes:
                self.bad(f"gc job for live inode {ino}")
            try:
                chains = unpack(raw)["layout"]["chains"]
                assert chains
            except Exception:
                self.bad(f"gc job for inode {ino}: no layout")
        for key, raw in self.items(DB_TRUNCATES):
            ino = U64.unpack(key)[0]
            rec = inodes.get(ino)
            if rec is None or not is_reg(rec):
                self.bad(f"truncate job for inode {ino}, which is not a live regular file")
            try:
                job = unpack(raw)
                assert job["size"] >= 0 and job["layout"]["chains"] and job["seq"] > 0
            except Exception:
                self.bad(f"truncate job for inode {ino}: malformed")

    def check_counters(
        self, counters: dict[bytes, int], inodes: dict[int, Rec], handles: Counter[int]
    ) -> None:
        def above(counter: bytes, ids: Iterator[int] | set[int] | list[int], what: str) -> None:
            top = max(ids, default=0)
            if counters.get(counter, 1) <= top:
                self.bad(f"counter {counter.decode()} {counters.get(counter, 1)} <= {what} {top}")

        gc = {int(U64.unpack(k)[0]) for k, _ in self.items(DB_GC)}
        above(C_INO, set(inodes) | gc, "inode")
        above(C_HANDLE, [int(U64.unpack(k[8:])[0]) for k, _ in self.items(DB_HANDLES)], "handle")
        above(C_SESSION, [int(U64.unpack(k)[0]) for k, _ in self.items(DB_SESSIONS)], "session")
        above(C_JOB, [int(unpack(v)["seq"]) for _, v in self.items(DB_TRUNCATES)], "truncate job")
