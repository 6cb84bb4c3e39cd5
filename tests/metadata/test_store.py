"""The namespace store, operation by operation, error case by error case.

Expected errnos are what Linux gives for the same call on a local filesystem.
Every test ends with fsck() == [] (the `ns` fixture checks it).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import msgpack
import pytest

from shufflefs.metadata.namespace import READDIR_MAX
from shufflefs.metadata.protocol import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INODE,
    SESSION_EXPIRED,
    XATTR_CREATE,
    XATTR_REPLACE,
    Layout,
)
from shufflefs.metadata.records import u64
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.txn import Tx
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from conftest import FakeClock, Fs

ROOT = ROOT_INODE
RDWR_CREATE = os.O_CREAT | os.O_RDWR


def code(fn: Callable[[], Any]) -> int:
    """The errno *fn* fails with (the test fails if it succeeds)."""
    with pytest.raises(FsError) as info:
        fn()
    return info.value.code


def no_layout() -> Layout:
    raise AssertionError("layout asked for, but no regular file should be created")


# ---- root, persistence, format ------------------------------------------------------


def test_root(ns: NamespaceStore) -> None:
    root = ns.getattr(ROOT)
    assert stat.S_ISDIR(root["mode"]) and stat.S_IMODE(root["mode"]) == 0o755
    assert (root["nlink"], root["uid"], root["gid"], root["parent"]) == (2, 0, 0, ROOT)
    assert ns.lookup(ROOT, b".")["ino"] == ROOT
    assert ns.lookup(ROOT, b"..")["ino"] == ROOT


def test_reopen_keeps_everything(ns_path: Path, clock: FakeClock) -> None:
    with NamespaceStore(ns_path, map_size=64 << 20, sync=True, clock=clock) as ns:
        ino = ns.mkdir(ROOT, b"d", 0o700, 5, 6)["ino"]
        ns.setxattr(ino, b"user.k", b"v")
        d = ns.getattr(ino)
    with NamespaceStore(ns_path, map_size=64 << 20, clock=clock) as ns:
        assert ns.lookup(ROOT, b"d") == d
        assert ns.getxattr(d["ino"], b"user.k") == b"v"
        assert ns.mkdir(ROOT, b"e", 0o700, 0, 0)["ino"] > d["ino"]  # ids never reused
        assert ns.fsck() == []


def test_refuses_other_format(ns_path: Path) -> None:
    NamespaceStore(ns_path, map_size=64 << 20).close()
    env = lmdb.open(str(ns_path), max_dbs=16, map_size=64 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"format", u64(99), db=env.open_db(b"info", txn=txn))
    env.close()
    assert code(lambda: NamespaceStore(ns_path, map_size=64 << 20)) == errno.EINVAL


# ---- name validation ----------------------------------------------------------------


def _name_ops(ns: NamespaceStore, fs: Fs, name: bytes) -> dict[str, Callable[[], Any]]:
    f = fs.file(ROOT, b"existing")
    d = fs.dir(ROOT, b"dir")
    return {
        "lookup": lambda: ns.lookup(ROOT, name),
        "mkdir": lambda: ns.mkdir(ROOT, name, 0o755, 0, 0),
        "mknod": lambda: ns.mknod(ROOT, name, stat.S_IFIFO | 0o644, 0, 0, 0, no_layout),
        "create": lambda: ns.create(ROOT, name, 0o644, RDWR_CREATE, 0, 0, fs.session, no_layout),
        "symlink": lambda: ns.symlink(ROOT, name, b"target", 0, 0),
        "link": lambda: ns.link(f, d, name),
        "unlink": lambda: ns.unlink(ROOT, name),
        "rmdir": lambda: ns.rmdir(ROOT, name),
        "rename-from": lambda: ns.rename(ROOT, name, d, b"x"),
        "rename-to": lambda: ns.rename(ROOT, b"existing", d, name),
    }


@pytest.mark.parametrize(
    "name,expected",
    [
        (b"", errno.EINVAL),
        (b"a/b", errno.EINVAL),
        (b"a\0b", errno.EINVAL),
        (b"x" * 256, errno.ENAMETOOLONG),
    ],
)
def test_bad_names(ns: NamespaceStore, fs: Fs, name: bytes, expected: int) -> None:
    for op, call in _name_ops(ns, fs, name).items():
        assert code(call) == expected, op


def test_longest_name(ns: NamespaceStore, fs: Fs) -> None:
    name = b"n" * 255
    ino = fs.file(ROOT, name)
    assert ns.lookup(ROOT, name)["ino"] == ino
    assert fs.names(ROOT) == [name]


def test_missing_and_non_directory_parents(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    for parent, expected in ((999, errno.ENOENT), (f, errno.ENOTDIR)):
        assert code(lambda p=parent: ns.lookup(p, b"x")) == expected
        assert code(lambda p=parent: ns.mkdir(p, b"x", 0o755, 0, 0)) == expected
        assert code(lambda p=parent: ns.mknod(p, b"x", 0o644, 0, 0, 0, no_layout)) == expected
        assert code(lambda p=parent: ns.symlink(p, b"x", b"t", 0, 0)) == expected
        assert code(lambda p=parent: ns.unlink(p, b"x")) == expected
        assert code(lambda p=parent: ns.rmdir(p, b"x")) == expected
        assert code(lambda p=parent: ns.readdir(p)) == expected
        assert code(lambda p=parent: ns.link(f, p, b"x")) == expected
        assert code(lambda p=parent: ns.rename(ROOT, b"f", p, b"x")) == expected
    assert code(lambda: ns.getattr(999)) == errno.ENOENT
    assert code(lambda: ns.lookup(ROOT, b"nothing")) == errno.ENOENT
    for bad in (0, -1, 1 << 64):
        assert code(lambda b=bad: ns.getattr(b)) == errno.EINVAL


def test_dot_names_as_new_names(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    excl = os.O_CREAT | os.O_EXCL | os.O_RDWR
    for dot in (b".", b".."):
        assert code(lambda d=dot: ns.mkdir(ROOT, d, 0o755, 0, 0)) == errno.EEXIST
        assert code(lambda d=dot: ns.mknod(ROOT, d, 0o644, 0, 0, 0, no_layout)) == errno.EEXIST
        assert code(lambda d=dot: ns.symlink(ROOT, d, b"t", 0, 0)) == errno.EEXIST
        assert code(lambda d=dot: ns.link(f, ROOT, d)) == errno.EEXIST
        assert code(lambda d=dot: ns.create(ROOT, d, 0o644, excl, 0, 0, fs.session, no_layout)) == (
            errno.EEXIST
        )
        assert code(
            lambda d=dot: ns.create(ROOT, d, 0o644, RDWR_CREATE, 0, 0, fs.session, no_layout)
        ) == (errno.EISDIR)
        assert code(lambda d=dot: ns.unlink(ROOT, d)) == errno.EISDIR
    assert code(lambda: ns.rmdir(ROOT, b".")) == errno.EINVAL
    assert code(lambda: ns.rmdir(ROOT, b"..")) == errno.ENOTEMPTY


# ---- creating -------------------------------------------------------------------------


def test_mkdir(ns: NamespaceStore, fs: Fs) -> None:
    before = ns.getattr(ROOT)
    d = ns.mkdir(ROOT, b"d", 0o7777, 7, 8)
    assert stat.S_ISDIR(d["mode"])
    assert stat.S_IMODE(d["mode"]) == 0o1777  # suid/sgid from the caller are dropped
    assert (d["nlink"], d["uid"], d["gid"], d["parent"], d["size"]) == (2, 7, 8, ROOT, 0)
    root = ns.getattr(ROOT)
    assert root["nlink"] == 3
    assert root["mtime"] > before["mtime"] and root["ctime"] > before["ctime"]
    assert root["mtime"] == d["ctime"]
    sub = ns.mkdir(d["ino"], b"sub", 0o755, 0, 0)
    assert sub["parent"] == d["ino"]
    assert ns.getattr(d["ino"])["nlink"] == 3
    assert ns.lookup(sub["ino"], b"..")["ino"] == d["ino"]
    assert code(lambda: ns.mkdir(ROOT, b"d", 0o755, 0, 0)) == errno.EEXIST
    assert ns.getattr(ROOT)["nlink"] == 3


def test_setgid_directory_inheritance(ns: NamespaceStore, fs: Fs) -> None:
    shared = ns.mkdir(ROOT, b"shared", 0o775, 0, 50)["ino"]
    ns.setattr(shared, mode=0o2775)
    sub = ns.mkdir(shared, b"sub", 0o755, 1000, 1000)
    assert sub["gid"] == 50 and sub["mode"] & stat.S_ISGID
    f = ns.mknod(shared, b"f", stat.S_IFREG | 0o644, 0, 1000, 1000, fs.layout)
    assert f["gid"] == 50 and not f["mode"] & stat.S_ISGID
    link = ns.symlink(shared, b"l", b"f", 1000, 1000)
    assert link["gid"] == 50
    plain = ns.mkdir(ROOT, b"plain", 0o755, 1000, 1000)
    assert plain["gid"] == 1000 and not plain["mode"] & stat.S_ISGID


def test_mknod_kinds(ns: NamespaceStore, fs: Fs) -> None:
    fifo = ns.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o640, 77, 1, 2, no_layout)
    assert stat.S_ISFIFO(fifo["mode"]) and stat.S_IMODE(fifo["mode"]) == 0o640
    assert fifo["rdev"] == 0  # only device files keep rdev
    sock = ns.mknod(ROOT, b"sock", stat.S_IFSOCK | 0o600, 0, 1, 2, no_layout)
    assert stat.S_ISSOCK(sock["mode"])
    chr_ = ns.mknod(ROOT, b"chr", stat.S_IFCHR | 0o600, os.makedev(1, 3), 0, 0, no_layout)
    blk = ns.mknod(ROOT, b"blk", stat.S_IFBLK | 0o600, os.makedev(8, 1), 0, 0, no_layout)
    assert chr_["rdev"] == os.makedev(1, 3) and blk["rdev"] == os.makedev(8, 1)
    reg = ns.mknod(ROOT, b"reg", 0o644, 0, 0, 0, fs.layout)  # no file type: regular
    assert stat.S_ISREG(reg["mode"]) and fs.layouts_made == 1
    assert ns.open(reg["ino"], os.O_RDONLY, fs.session)["layout"] == fs.layout()
    assert ns.open(fifo["ino"], os.O_RDONLY, fs.session)["layout"] is None
    assert code(lambda: ns.mknod(ROOT, b"d", stat.S_IFDIR | 0o755, 0, 0, 0, no_layout)) == (
        errno.EPERM
    )
    assert code(lambda: ns.mknod(ROOT, b"l", stat.S_IFLNK | 0o777, 0, 0, 0, no_layout)) == (
        errno.EINVAL
    )
    assert code(lambda: ns.mknod(ROOT, b"fifo", stat.S_IFREG, 0, 0, 0, no_layout)) == errno.EEXIST
    ns.session_close(fs.session)


def test_no_layout_means_enospc_for_files_only(ns: NamespaceStore, fs: Fs) -> None:
    def full() -> Layout:
        raise FsError(errno.ENOSPC, "no writable storage chains")

    assert code(lambda: ns.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, 0, 0, full)) == errno.ENOSPC
    assert (
        code(lambda: ns.create(ROOT, b"f", 0o644, RDWR_CREATE, 0, 0, fs.session, full))
        == errno.ENOSPC
    )
    assert fs.names(ROOT) == []  # the failed transactions left nothing behind
    ns.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o644, 0, 0, 0, full)
    ns.mkdir(ROOT, b"d", 0o755, 0, 0)
    existing = fs.file(ROOT, b"g")
    opened = ns.create(ROOT, b"g", 0o644, RDWR_CREATE, 0, 0, fs.session, full)
    assert opened["attr"]["ino"] == existing
    ns.session_close(fs.session)


def test_create_and_open(ns: NamespaceStore, fs: Fs) -> None:
    excl = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    made = ns.create(ROOT, b"f", 0o4755, excl, 3, 4, fs.session, fs.layout)
    attr = made["attr"]
    assert stat.S_ISREG(attr["mode"]) and stat.S_IMODE(attr["mode"]) == 0o4755
    assert (attr["uid"], attr["gid"], attr["nlink"], attr["size"]) == (3, 4, 1, 0)
    assert made["layout"] == {"chunk_size": 1 << 20, "chains": [1, 2]}
    assert code(lambda: ns.create(ROOT, b"f", 0o644, excl, 0, 0, fs.session, no_layout)) == (
        errno.EEXIST
    )
    again = ns.create(ROOT, b"f", 0o600, RDWR_CREATE, 0, 0, fs.session, no_layout)
    assert again["attr"]["ino"] == attr["ino"] and again["handle"] != made["handle"]
    assert stat.S_IMODE(again["attr"]["mode"]) == 0o4755  # an existing file keeps its mode
    opened = ns.open(attr["ino"], os.O_RDONLY, fs.session)
    assert opened["attr"] == ns.getattr(attr["ino"])
    fs.dir(ROOT, b"d")
    ns.symlink(ROOT, b"l", b"f", 0, 0)
    assert (
        code(lambda: ns.create(ROOT, b"d", 0o644, RDWR_CREATE, 0, 0, fs.session, no_layout))
        == errno.EISDIR
    )
    assert (
        code(lambda: ns.create(ROOT, b"l", 0o644, RDWR_CREATE, 0, 0, fs.session, no_layout))
        == errno.ELOOP
    )
    ns.session_close(fs.session)


def test_open_directory_and_symlink(ns: NamespaceStore, fs: Fs) -> None:
    d = fs.dir(ROOT, b"d")
    handle = ns.open(d, os.O_RDONLY | os.O_DIRECTORY, fs.session)["handle"]
    ns.release(d, handle, fs.session)
    assert code(lambda: ns.open(d, os.O_WRONLY, fs.session)) == errno.EISDIR
    assert code(lambda: ns.open(d, os.O_RDONLY | os.O_TRUNC, fs.session)) == errno.EISDIR
    link = ns.symlink(ROOT, b"l", b"d", 0, 0)["ino"]
    assert code(lambda: ns.open(link, os.O_RDONLY, fs.session)) == errno.ELOOP
    assert code(lambda: ns.open(999, os.O_RDONLY, fs.session)) == errno.ENOENT


def test_open_with_dead_session(ns: NamespaceStore, fs: Fs, clock: FakeClock) -> None:
    f = fs.file(ROOT, b"f")
    assert code(lambda: ns.open(f, os.O_RDONLY, 12345)) == SESSION_EXPIRED
    assert (
        code(lambda: ns.create(ROOT, b"g", 0o644, RDWR_CREATE, 0, 0, 12345, no_layout))
        == SESSION_EXPIRED
    )
    clock.advance(61)
    assert code(lambda: ns.open(f, os.O_RDONLY, fs.session)) == SESSION_EXPIRED
    assert fs.names(ROOT) == [b"f"]
    ns.reap_sessions()


def test_o_trunc(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    ns.update_length(ino, 5000)
    before = ns.getattr(ino)
    opened = ns.open(ino, os.O_WRONLY | os.O_TRUNC, fs.session)
    assert opened["attr"]["size"] == 0 and opened["attr"]["mtime"] > before["mtime"]
    job = ns.truncate_job(ino)
    assert job is not None and job["size"] == 0 and job["layout"] == fs.layout()
    assert ns.truncate_done(ino, job["seq"])
    again = ns.create(ROOT, b"f", 0o644, RDWR_CREATE | os.O_TRUNC, 0, 0, fs.session, no_layout)
    assert again["attr"]["size"] == 0
    assert ns.truncate_job(ino) is None  # nothing to cut from an empty file
    fifo = ns.mknod(ROOT, b"p", stat.S_IFIFO | 0o600, 0, 0, 0, no_layout)["ino"]
    ns.open(fifo, os.O_WRONLY | os.O_TRUNC, fs.session)  # ignored for special files
    ns.session_close(fs.session)


# ---- attributes --------------------------------------------------------------------


def test_setattr(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    before = ns.getattr(ino)
    attr = ns.setattr(ino, mode=0o104755, uid=5, gid=6, atime=-10, mtime=1234)
    assert attr["mode"] == stat.S_IFREG | 0o4755  # file type bits cannot change
    assert (attr["uid"], attr["gid"], attr["atime"], attr["mtime"]) == (5, 6, -10, 1234)
    assert attr["ctime"] > before["ctime"]
    assert ns.getattr(ino) == attr
    assert ns.setattr(ino, mode=0o1777)["mode"] == stat.S_IFREG | 0o1777
    d = fs.dir(ROOT, b"d")
    assert stat.S_ISDIR(ns.setattr(d, mode=0o700)["mode"])
    for bad in ({"uid": -1}, {"gid": 1 << 32}, {"size": -1}, {"mode": -1}, {"atime": 1 << 63}):
        assert code(lambda b=bad: ns.setattr(ino, **b)) == errno.EINVAL
    assert code(lambda: ns.setattr(999, mode=0o644)) == errno.ENOENT


def test_setattr_size(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    before = ns.getattr(ino)
    grown = ns.setattr(ino, size=10_000)
    assert grown["size"] == 10_000 and grown["mtime"] > before["mtime"]
    assert ns.truncate_job(ino) is None  # growing needs nothing from storage
    ns.setattr(ino, size=4000)
    job = ns.truncate_job(ino)
    assert job is not None and job["size"] == 4000
    ns.setattr(ino, size=8000)
    ns.setattr(ino, size=6000)  # a pending cut to 4000 keeps the smaller size
    newer = ns.truncate_job(ino)
    assert newer is not None and newer["size"] == 4000 and newer["seq"] > job["seq"]
    assert not ns.truncate_done(ino, job["seq"])  # stale: the newer job must run too
    assert ns.truncate_done(ino, newer["seq"])
    assert [j["ino"] for j in ns.truncate_jobs()] == []
    limit = (1 << 20) * (1 << 32)
    assert ns.setattr(ino, size=limit)["size"] == limit
    assert code(lambda: ns.setattr(ino, size=limit + 1)) == errno.EFBIG
    explicit = ns.setattr(ino, size=limit, mtime=77)
    assert explicit["mtime"] == 77
    d = fs.dir(ROOT, b"d")
    link = ns.symlink(ROOT, b"l", b"f", 0, 0)["ino"]
    assert code(lambda: ns.setattr(d, size=0)) == errno.EISDIR
    assert code(lambda: ns.setattr(link, size=0)) == errno.EINVAL


def test_update_length(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    before = ns.getattr(ino)
    attr = ns.update_length(ino, 100)
    assert attr["size"] == 100 and attr["mtime"] == before["mtime"]
    attr = ns.update_length(ino, 50, mtime=before["mtime"] + 5)
    assert attr["size"] == 100  # never shrinks
    assert attr["mtime"] == attr["ctime"] == before["mtime"] + 5
    assert ns.truncate_job(ino) is None
    assert code(lambda: ns.update_length(ino, -1)) == errno.EINVAL
    assert code(lambda: ns.update_length(ino, (1 << 52) + 1)) == errno.EFBIG
    assert code(lambda: ns.update_length(fs.dir(ROOT, b"d"), 1)) == errno.EISDIR
    assert code(lambda: ns.update_length(999, 1)) == errno.ENOENT


# ---- removing ------------------------------------------------------------------------


def test_unlink(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    ns.link(ino, ROOT, b"g")
    ns.setxattr(ino, b"user.a", b"1")
    before = ns.getattr(ino)
    root_before = ns.getattr(ROOT)
    unlinked = ns.unlink(ROOT, b"f")
    assert not unlinked["freed"]
    assert unlinked["parent_attr"] == ns.getattr(ROOT)  # the directory after it
    after = ns.getattr(ino)
    assert after["nlink"] == 1 and after["ctime"] > before["ctime"]
    assert ns.getattr(ROOT)["mtime"] > root_before["mtime"]
    assert code(lambda: ns.unlink(ROOT, b"f")) == errno.ENOENT
    assert ns.unlink(ROOT, b"g")["freed"]  # the last name: freed
    assert code(lambda: ns.getattr(ino)) == errno.ENOENT
    assert [j["ino"] for j in ns.gc_jobs()] == [ino]
    assert ns.gc_jobs()[0]["layout"] == fs.layout()
    ns.gc_done(ino)
    fs.dir(ROOT, b"d")
    assert code(lambda: ns.unlink(ROOT, b"d")) == errno.EISDIR
    fifo = ns.mknod(ROOT, b"p", stat.S_IFIFO | 0o600, 0, 0, 0, no_layout)["ino"]
    assert ns.unlink(ROOT, b"p")["freed"]
    assert code(lambda: ns.getattr(fifo)) == errno.ENOENT
    assert ns.gc_jobs() == []  # nothing on storage for a FIFO
    env = ns.env
    with env.begin() as txn:  # xattrs went with the inode
        assert txn.get(u64(ino) + b"user.a", db=ns.dbs[b"xattrs"]) is None


def test_rmdir(ns: NamespaceStore, fs: Fs) -> None:
    d = fs.dir(ROOT, b"d")
    sub = fs.dir(d, b"sub")
    fs.file(sub, b"f")
    assert code(lambda: ns.rmdir(ROOT, b"d")) == errno.ENOTEMPTY
    assert code(lambda: ns.rmdir(sub, b"f")) == errno.ENOTDIR
    assert code(lambda: ns.rmdir(d, b"missing")) == errno.ENOENT
    ns.unlink(sub, b"f")
    ns.gc_done(ns.gc_jobs()[0]["ino"])
    assert ns.getattr(d)["nlink"] == 3
    ns.rmdir(d, b"sub")
    assert ns.getattr(d)["nlink"] == 2
    assert code(lambda: ns.getattr(sub)) == errno.ENOENT
    ns.rmdir(ROOT, b"d")
    assert ns.getattr(ROOT)["nlink"] == 2
    assert fs.names(ROOT) == []
    assert ns.gc_jobs() == []


# ---- rename -----------------------------------------------------------------------------


def test_rename_within_and_across(ns: NamespaceStore, fs: Fs) -> None:
    a = fs.dir(ROOT, b"a")
    b = fs.dir(ROOT, b"b")
    f = fs.file(a, b"f")
    before = ns.getattr(f)
    ns.rename(a, b"f", a, b"g")
    assert fs.names(a) == [b"g"] and ns.lookup(a, b"g")["ino"] == f
    assert ns.getattr(f)["ctime"] > before["ctime"]
    ns.rename(a, b"g", b, b"h")
    assert fs.names(a) == [] and fs.names(b) == [b"h"]
    sub = fs.dir(a, b"sub")
    assert ns.getattr(a)["nlink"] == 3
    ns.rename(a, b"sub", b, b"sub2")
    assert ns.getattr(a)["nlink"] == 2 and ns.getattr(b)["nlink"] == 3
    assert ns.getattr(sub)["parent"] == b
    assert ns.lookup(sub, b"..")["ino"] == b
    ns.rename(b, b"sub2", b, b"sub3")  # within one directory: nlink unchanged
    assert ns.getattr(b)["nlink"] == 3 and ns.getattr(sub)["parent"] == b
    assert code(lambda: ns.rename(a, b"missing", b, b"x")) == errno.ENOENT


def test_rename_over_existing(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    g = fs.file(ROOT, b"g")
    assert ns.rename(ROOT, b"f", ROOT, b"g")  # g's inode is freed
    assert fs.names(ROOT) == [b"g"] and ns.lookup(ROOT, b"g")["ino"] == f
    assert code(lambda: ns.getattr(g)) == errno.ENOENT
    assert [j["ino"] for j in ns.gc_jobs()] == [g]
    ns.gc_done(g)
    d = fs.dir(ROOT, b"d")
    e = fs.dir(ROOT, b"e")
    full = fs.dir(ROOT, b"full")
    fs.file(full, b"x")
    assert ns.getattr(ROOT)["nlink"] == 5
    assert code(lambda: ns.rename(ROOT, b"g", ROOT, b"d")) == errno.EISDIR
    assert code(lambda: ns.rename(ROOT, b"d", ROOT, b"g")) == errno.ENOTDIR
    assert code(lambda: ns.rename(ROOT, b"d", ROOT, b"full")) == errno.ENOTEMPTY
    ns.rename(ROOT, b"d", ROOT, b"e")  # over an empty directory
    assert ns.getattr(ROOT)["nlink"] == 4
    assert ns.lookup(ROOT, b"e")["ino"] == d
    assert code(lambda: ns.getattr(e)) == errno.ENOENT
    inner = fs.dir(d, b"inner")
    ns.rename(d, b"inner", ROOT, b"full2")
    assert ns.getattr(inner)["parent"] == ROOT and ns.getattr(d)["nlink"] == 2


def test_rename_into_own_subtree(ns: NamespaceStore, fs: Fs) -> None:
    a = fs.dir(ROOT, b"a")
    b = fs.dir(a, b"b")
    c = fs.dir(b, b"c")
    assert code(lambda: ns.rename(ROOT, b"a", c, b"a")) == errno.EINVAL
    assert code(lambda: ns.rename(ROOT, b"a", a, b"x")) == errno.EINVAL
    assert code(lambda: ns.rename(a, b"b", b, b"x")) == errno.EINVAL
    # the destination is an ancestor of the source: not empty
    assert code(lambda: ns.rename(b, b"c", ROOT, b"a")) == errno.ENOTEMPTY
    fs.file(b, b"f")
    assert code(lambda: ns.rename(b, b"f", ROOT, b"a")) == errno.ENOTEMPTY
    assert code(lambda: ns.rename(b, b"c", ROOT, b"a", RENAME_EXCHANGE)) == errno.EINVAL
    assert code(lambda: ns.rename(ROOT, b"a", b, b"c", RENAME_EXCHANGE)) == errno.EINVAL
    ns.rename(b, b"c", ROOT, b"c")  # moving up is fine
    assert ns.getattr(c)["parent"] == ROOT


def test_rename_flags(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    g = fs.file(ROOT, b"g")
    assert code(lambda: ns.rename(ROOT, b"f", ROOT, b"g", RENAME_NOREPLACE)) == errno.EEXIST
    ns.rename(ROOT, b"f", ROOT, b"h", RENAME_NOREPLACE)
    assert fs.names(ROOT) == [b"g", b"h"]
    assert code(lambda: ns.rename(ROOT, b"h", ROOT, b"x", RENAME_EXCHANGE)) == errno.ENOENT
    ns.rename(ROOT, b"h", ROOT, b"g", RENAME_EXCHANGE)
    assert ns.lookup(ROOT, b"g")["ino"] == f and ns.lookup(ROOT, b"h")["ino"] == g
    both = RENAME_EXCHANGE | RENAME_NOREPLACE
    assert code(lambda: ns.rename(ROOT, b"h", ROOT, b"g", both)) == errno.EINVAL
    assert code(lambda: ns.rename(ROOT, b"h", ROOT, b"g", 8)) == errno.EINVAL
    assert code(lambda: ns.rename(ROOT, b".", ROOT, b"x")) == errno.EBUSY
    assert code(lambda: ns.rename(ROOT, b"..", ROOT, b"x")) == errno.EBUSY
    assert code(lambda: ns.rename(ROOT, b"g", ROOT, b"..")) == errno.EBUSY
    assert code(lambda: ns.rename(ROOT, b"g", ROOT, b".", RENAME_NOREPLACE)) == errno.EEXIST


def test_rename_exchange_directory_and_file(ns: NamespaceStore, fs: Fs) -> None:
    a = fs.dir(ROOT, b"a")
    b = fs.dir(ROOT, b"b")
    d = fs.dir(a, b"d")
    fs.file(d, b"inside")  # a non-empty directory can be exchanged
    f = fs.file(b, b"f")
    ns.rename(a, b"d", b, b"f", RENAME_EXCHANGE)
    assert ns.lookup(a, b"d")["ino"] == f and ns.lookup(b, b"f")["ino"] == d
    assert ns.getattr(d)["parent"] == b
    assert ns.getattr(a)["nlink"] == 2 and ns.getattr(b)["nlink"] == 3
    e = fs.dir(a, b"e")
    ns.rename(a, b"e", b, b"f", RENAME_EXCHANGE)  # two directories
    assert ns.getattr(e)["parent"] == b and ns.getattr(d)["parent"] == a
    assert ns.getattr(a)["nlink"] == 3 and ns.getattr(b)["nlink"] == 3


def test_rename_onto_own_hard_link_is_a_no_op(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    d = fs.dir(ROOT, b"d")
    ns.link(f, d, b"g")
    assert not ns.rename(ROOT, b"f", d, b"g")
    assert fs.names(ROOT) == [b"d", b"f"] and fs.names(d) == [b"g"]
    assert ns.getattr(f)["nlink"] == 2
    ns.rename(ROOT, b"f", ROOT, b"f")
    ns.rename(ROOT, b"d", ROOT, b"d")
    assert ns.getattr(ROOT)["nlink"] == 3


def test_rename_over_open_file_keeps_it(ns: NamespaceStore, fs: Fs) -> None:
    victim, handle = fs.open_new(ROOT, b"victim")
    fs.file(ROOT, b"new")
    assert not ns.rename(ROOT, b"new", ROOT, b"victim")
    assert ns.getattr(victim)["nlink"] == 0
    assert ns.gc_jobs() == []
    assert ns.release(victim, handle, fs.session)
    assert [j["ino"] for j in ns.gc_jobs()] == [victim]
    ns.gc_done(victim)


# ---- links ---------------------------------------------------------------------------------


def test_link(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    d = fs.dir(ROOT, b"d")
    before = ns.getattr(f)
    attr = ns.link(f, d, b"g")
    assert attr["nlink"] == 2 and attr["ctime"] > before["ctime"]
    assert ns.lookup(d, b"g") == ns.getattr(f)
    assert code(lambda: ns.link(f, d, b"g")) == errno.EEXIST
    assert code(lambda: ns.link(d, ROOT, b"d2")) == errno.EPERM
    assert code(lambda: ns.link(999, ROOT, b"x")) == errno.ENOENT
    ino, handle = fs.open_new(ROOT, b"tmp")
    ns.unlink(ROOT, b"tmp")
    assert code(lambda: ns.link(ino, ROOT, b"back")) == errno.ENOENT
    ns.release(ino, handle, fs.session)
    ns.gc_done(ino)


def test_symlink_and_readlink(ns: NamespaceStore, fs: Fs) -> None:
    attr = ns.symlink(ROOT, b"l", b"some/where", 3, 4)
    assert attr["mode"] == stat.S_IFLNK | 0o777
    assert (attr["size"], attr["uid"], attr["gid"], attr["nlink"]) == (10, 3, 4, 1)
    assert ns.readlink(attr["ino"]) == b"some/where"
    longest = ns.symlink(ROOT, b"long", b"x" * 4095, 0, 0)
    assert ns.readlink(longest["ino"]) == b"x" * 4095
    assert code(lambda: ns.symlink(ROOT, b"l2", b"x" * 4096, 0, 0)) == errno.ENAMETOOLONG
    assert code(lambda: ns.symlink(ROOT, b"l3", b"", 0, 0)) == errno.ENOENT
    assert code(lambda: ns.symlink(ROOT, b"l", b"t", 0, 0)) == errno.EEXIST
    assert code(lambda: ns.readlink(fs.file(ROOT, b"f"))) == errno.EINVAL
    assert code(lambda: ns.readlink(ROOT)) == errno.EINVAL
    ns.link(attr["ino"], ROOT, b"hard-to-symlink")  # allowed, as on Linux
    assert ns.getattr(attr["ino"])["nlink"] == 2


# ---- resolve -------------------------------------------------------------------------------


def test_resolve(ns: NamespaceStore, fs: Fs) -> None:
    a = fs.dir(ROOT, b"a")
    b = fs.dir(a, b"b")
    f = fs.file(b, b"f")
    ns.symlink(ROOT, b"abs", b"/a/b", 0, 0)
    ns.symlink(a, b"rel", b"b/f", 0, 0)
    ns.symlink(a, b"up", b"../a/b/", 0, 0)
    link_to_file = ns.symlink(ROOT, b"lf", b"a/rel", 0, 0)["ino"]
    ns.symlink(ROOT, b"dangling", b"nowhere", 0, 0)
    assert ns.resolve(b"/")["ino"] == ROOT
    assert ns.resolve(b"/a/b/f")["ino"] == f
    assert ns.resolve(b"//a//./b/../b/f")["ino"] == f
    assert ns.resolve(b"/..")["ino"] == ROOT
    assert ns.resolve(b"/abs/f")["ino"] == f
    assert ns.resolve(b"/a/rel")["ino"] == f
    assert ns.resolve(b"/a/up/f")["ino"] == f
    assert ns.resolve(b"/lf")["ino"] == f
    assert ns.resolve(b"/lf", follow=False)["ino"] == link_to_file
    assert ns.resolve(b"/abs/", follow=False)["ino"] == b  # a trailing slash follows
    assert ns.resolve(b"/a/b/")["ino"] == b
    assert code(lambda: ns.resolve(b"/a/b/f/")) == errno.ENOTDIR
    assert code(lambda: ns.resolve(b"/lf/")) == errno.ENOTDIR
    assert code(lambda: ns.resolve(b"/a/b/f/x")) == errno.ENOTDIR
    assert code(lambda: ns.resolve(b"/a/missing/f")) == errno.ENOENT
    assert code(lambda: ns.resolve(b"/dangling")) == errno.ENOENT
    assert ns.resolve(b"/dangling", follow=False)["mode"] == stat.S_IFLNK | 0o777
    assert code(lambda: ns.resolve(b"a/b")) == errno.EINVAL
    assert code(lambda: ns.resolve(b"")) == errno.ENOENT
    assert code(lambda: ns.resolve(b"/" + b"x" * 256)) == errno.ENAMETOOLONG
    assert code(lambda: ns.resolve(b"/x" * 2100)) == errno.ENAMETOOLONG


def test_resolve_symlink_limits(ns: NamespaceStore, fs: Fs) -> None:
    target = fs.file(ROOT, b"l0")
    for i in range(1, 42):
        ns.symlink(ROOT, b"l%d" % i, b"l%d" % (i - 1), 0, 0)
    assert ns.resolve(b"/l40")["ino"] == target  # 40 links: the most Linux follows
    assert code(lambda: ns.resolve(b"/l41")) == errno.ELOOP
    assert ns.resolve(b"/l41", follow=False)["ino"] != target
    ns.symlink(ROOT, b"loop1", b"loop2", 0, 0)
    ns.symlink(ROOT, b"loop2", b"/loop1", 0, 0)
    assert code(lambda: ns.resolve(b"/loop1")) == errno.ELOOP
    assert code(lambda: ns.resolve(b"/loop1/x", follow=False)) == errno.ELOOP


# ---- readdir ----------------------------------------------------------------------------------


def test_readdir_pages(ns: NamespaceStore, fs: Fs) -> None:
    names = sorted(b"n%03d" % i for i in range(25))
    inos = {name: fs.file(ROOT, name) for name in reversed(names)}
    seen: list[bytes] = []
    after = None
    pages = 0
    while True:
        page = ns.readdir(ROOT, after, 7)
        pages += 1
        assert len(page["entries"]) <= 7
        for name, attr in page["entries"]:
            assert attr == ns.getattr(inos[name])
            seen.append(name)
        if not page["more"]:
            break
        after = page["entries"][-1][0]
    assert seen == names and pages == 4
    assert ns.readdir(ROOT, names[-1], 5) == {"entries": [], "more": False}
    assert [n for n, _ in ns.readdir(ROOT, b"n0105", 2)["entries"]] == [b"n011", b"n012"]
    assert code(lambda: ns.readdir(ROOT, None, 0)) == errno.EINVAL
    assert code(lambda: ns.readdir(inos[names[0]])) == errno.ENOTDIR
    assert ns.readdir(fs.dir(ROOT, b"zz-empty")) == {"entries": [], "more": False}


def test_a_listing_inside_a_write_sees_the_transactions_own_changes(
    ns: NamespaceStore, fs: Fs
) -> None:
    """`Tx.children` reads records past the transaction's inode cache
    unless the transaction holds one: its own change is what it lists."""
    ino = fs.file(ROOT, b"f")
    fs.file(ROOT, b"g")

    def body(tx: Tx) -> list[tuple[bytes, int, int]]:
        tx.inode(ino)["size"] = 4321
        children, more = tx.children(ROOT, None, 10)
        assert not more
        return [(name, child, rec["size"]) for name, child, rec in children]

    listed = ns.txns.write(body)
    assert [(name, size) for name, _, size in listed] == [(b"f", 4321), (b"g", 0)]
    assert listed[0][1] == ino


def test_readdir_page_size_is_capped(ns: NamespaceStore, fs: Fs) -> None:
    for i in range(READDIR_MAX + 5):
        fs.file(ROOT, b"%05d" % i)
    page = ns.readdir(ROOT, None, 1 << 30)
    assert len(page["entries"]) == READDIR_MAX and page["more"]


def test_readdir_stable_under_concurrent_changes(ns: NamespaceStore, fs: Fs) -> None:
    """Entries present for the whole listing appear exactly once, whatever
    is inserted or removed (before or after the cursor) between pages."""
    stable = {b"s%02d" % i for i in range(0, 40, 2)}
    doomed = {b"s%02d" % i for i in range(1, 40, 4)}
    for name in stable | doomed:
        fs.file(ROOT, name)
    seen: list[bytes] = []
    after = None
    step = 0
    while True:
        page = ns.readdir(ROOT, after, 3)
        seen.extend(name for name, _ in page["entries"])
        if not page["more"]:
            break
        after = page["entries"][-1][0]
        step += 1
        fs.file(ROOT, b"a-new%02d" % step)  # before the cursor
        fs.file(ROOT, after + b"-new")  # right after the cursor
        fs.file(ROOT, b"z-new%02d" % step)  # far ahead
        gone = sorted(doomed - set(seen))
        if gone:
            ns.unlink(ROOT, gone[-1])
            doomed.discard(gone[-1])
        if step == 2:  # the cursor entry itself disappears
            ns.unlink(ROOT, after)
            stable.discard(after)
            doomed.discard(after)
    assert len(seen) == len(set(seen))
    assert stable <= set(seen)
    for job in ns.gc_jobs():
        ns.gc_done(job["ino"])


# ---- statfs --------------------------------------------------------------------------------------


def test_statfs(ns: NamespaceStore, fs: Fs) -> None:
    first = ns.statfs()
    assert first["files"] == 1 and first["max_files"] > 1000
    fs.dir(ROOT, b"d")
    fs.file(ROOT, b"f")
    assert ns.statfs()["files"] == 3


# ---- xattrs --------------------------------------------------------------------------------------


def test_xattrs(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    before = ns.getattr(f)
    ns.setxattr(f, b"user.b", b"2")
    assert ns.getattr(f)["ctime"] > before["ctime"]
    ns.setxattr(f, b"user.a", b"")
    ns.setxattr(f, b"trusted.t", b"x" * 65536)
    ns.setxattr(f, b"security.selinux", b"ctx")
    ns.setxattr(f, b"system.other", b"s")
    assert ns.getxattr(f, b"user.a") == b""
    assert ns.listxattr(f) == [
        b"security.selinux",
        b"system.other",
        b"trusted.t",
        b"user.a",
        b"user.b",
    ]
    assert code(lambda: ns.setxattr(f, b"user.a", b"v", XATTR_CREATE)) == errno.EEXIST
    assert code(lambda: ns.setxattr(f, b"user.c", b"v", XATTR_REPLACE)) == errno.ENODATA
    ns.setxattr(f, b"user.a", b"new", XATTR_REPLACE)
    ns.setxattr(f, b"user.c", b"v", XATTR_CREATE)
    assert ns.getxattr(f, b"user.a") == b"new"
    ns.removexattr(f, b"user.a")
    assert code(lambda: ns.getxattr(f, b"user.a")) == errno.ENODATA
    assert code(lambda: ns.removexattr(f, b"user.a")) == errno.ENODATA
    assert code(lambda: ns.setxattr(f, b"user.a", b"v", 4)) == errno.EINVAL
    assert code(lambda: ns.listxattr(999)) == errno.ENOENT
    assert code(lambda: ns.getxattr(999, b"user.a")) == errno.ENOENT
    assert ns.listxattr(fs.dir(ROOT, b"d")) == []


@pytest.mark.parametrize(
    "name,expected",
    [
        (b"", errno.ERANGE),
        (b"user." + b"x" * 251, errno.ERANGE),
        (b"other.x", errno.EOPNOTSUPP),
        (b"userx", errno.EOPNOTSUPP),
        (b"user.", errno.EINVAL),
        (b"system.posix_acl_access", errno.EOPNOTSUPP),
        (b"system.posix_acl_default", errno.EOPNOTSUPP),
        (b"user.a\0b", errno.EINVAL),
    ],
)
def test_xattr_names(ns: NamespaceStore, fs: Fs, name: bytes, expected: int) -> None:
    f = fs.file(ROOT, b"f")
    assert code(lambda: ns.setxattr(f, name, b"v")) == expected
    assert code(lambda: ns.getxattr(f, name)) == expected
    assert code(lambda: ns.removexattr(f, name)) == expected


def test_xattr_limits(ns: NamespaceStore, fs: Fs) -> None:
    f = fs.file(ROOT, b"f")
    longest = b"user." + b"x" * 250
    ns.setxattr(f, longest, b"v")
    assert ns.getxattr(f, longest) == b"v"
    assert code(lambda: ns.setxattr(f, b"user.big", b"x" * 65537)) == errno.E2BIG
    # all names of one inode must fit a 64 KiB listxattr buffer
    added = 0
    with pytest.raises(FsError) as info:
        while True:
            ns.setxattr(f, b"user.%0240d" % added, b"")
            added += 1
    assert info.value.code == errno.ENOSPC and 250 < added < 280
    ns.setxattr(f, b"user.%0240d" % 0, b"replacing an existing name still works")


def test_user_xattrs_only_on_files_and_directories(ns: NamespaceStore, fs: Fs) -> None:
    link = ns.symlink(ROOT, b"l", b"t", 0, 0)["ino"]
    fifo = ns.mknod(ROOT, b"p", stat.S_IFIFO | 0o600, 0, 0, 0, no_layout)["ino"]
    for ino in (link, fifo):
        assert code(lambda i=ino: ns.setxattr(i, b"user.a", b"v")) == errno.EPERM
        assert code(lambda i=ino: ns.getxattr(i, b"user.a")) == errno.ENODATA
        assert code(lambda i=ino: ns.removexattr(i, b"user.a")) == errno.EPERM
        ns.setxattr(ino, b"trusted.a", b"v")
        assert ns.getxattr(ino, b"trusted.a") == b"v"
    ns.setxattr(fs.dir(ROOT, b"d"), b"user.ok", b"v")


# ---- sessions and file lifetime ---------------------------------------------------------------


def test_sessions(ns: NamespaceStore, clock: FakeClock) -> None:
    s = ns.session_open("client", "host", 42)
    assert s["lease"] == 60.0 and s["session"] > 0
    other = ns.session_open("client", "host", 43)["session"]
    assert other != s["session"]
    clock.advance(50)
    ns.session_renew(s["session"])
    clock.advance(50)  # 100 s after opening but 50 after the renewal
    ns.session_renew(s["session"])
    assert code(lambda: ns.session_renew(other)) == errno.ENOENT
    assert [e["session"] for e in ns.reap_sessions()] == [other]
    ns.session_close(s["session"])
    assert code(lambda: ns.session_renew(s["session"])) == errno.ENOENT
    assert code(lambda: ns.session_renew(123456)) == errno.ENOENT
    assert code(lambda: ns.session_renew(0)) == errno.ENOENT
    assert ns.session_close(123456) == (0, 0)  # closing twice is harmless
    assert code(lambda: ns.session_open("c" * 300, "h", 1)) == errno.EINVAL
    assert code(lambda: ns.session_open("c", "h", -1)) == errno.EINVAL


def test_open_unlinked_file_lives_until_last_release(ns: NamespaceStore, fs: Fs) -> None:
    ino, h1 = fs.open_new(ROOT, b"f")
    h2 = ns.open(ino, os.O_RDONLY, fs.session)["handle"]
    ns.unlink(ROOT, b"f")
    attr = ns.getattr(ino)
    assert attr["nlink"] == 0
    assert ns.update_length(ino, 4096)["size"] == 4096  # still writable
    assert ns.open(ino, os.O_RDONLY, fs.session)["attr"]["nlink"] == 0
    assert ns.fsck() == []
    assert ns.gc_jobs() == []
    assert not ns.release(ino, h1, fs.session)
    ns.getattr(ino)
    assert code(lambda: ns.release(ino, h2, 999)) == errno.EBADF
    assert not ns.release(ino, h2, fs.session)
    assert ns.fsck() == []
    ns.session_close(fs.session)  # closes the third handle
    assert code(lambda: ns.getattr(ino)) == errno.ENOENT
    assert [j["ino"] for j in ns.gc_jobs()] == [ino]
    assert not ns.release(ino, h1, fs.session)  # already released: not an error
    ns.gc_done(ino)


def test_session_expiry_frees_unlinked_files(ns: NamespaceStore, fs: Fs, clock: FakeClock) -> None:
    dying = ns.session_open("dying", "h", 1)["session"]
    result = ns.create(ROOT, b"f", 0o644, RDWR_CREATE, 0, 0, dying, fs.layout)
    ino = result["attr"]["ino"]
    kept, kept_handle = fs.open_new(ROOT, b"kept")
    ns.unlink(ROOT, b"f")
    ns.unlink(ROOT, b"kept")
    clock.advance(30)
    ns.session_renew(fs.session)
    assert ns.reap_sessions() == []
    clock.advance(31)
    expired = ns.reap_sessions()
    assert [(e["session"], e["handles"], e["freed"]) for e in expired] == [(dying, 1, 1)]
    assert expired[0]["client"] == "dying"
    assert code(lambda: ns.getattr(ino)) == errno.ENOENT
    assert [j["ino"] for j in ns.gc_jobs()] == [ino]
    assert ns.getattr(kept)["nlink"] == 0  # the live session still holds it
    ns.release(kept, kept_handle, fs.session)
    assert sorted(j["ino"] for j in ns.gc_jobs()) == [ino, kept]
    for job in ns.gc_jobs():
        ns.gc_done(job["ino"])


def test_restart_gives_sessions_a_fresh_lease(ns_path: Path, clock: FakeClock) -> None:
    with NamespaceStore(ns_path, map_size=64 << 20, clock=clock) as ns:
        s = ns.session_open("c", "h", 1)["session"]
    clock.advance(3600)  # the server was down for an hour
    with NamespaceStore(ns_path, map_size=64 << 20, clock=clock) as ns:
        assert ns.restart_leases() == 1
        assert ns.reap_sessions() == []
        ns.session_renew(s)


def test_removed_directory_held_open(ns: NamespaceStore, fs: Fs) -> None:
    d = fs.dir(ROOT, b"d")
    handle = ns.open(d, os.O_RDONLY, fs.session)["handle"]
    ns.rmdir(ROOT, b"d")
    attr = ns.getattr(d)
    assert attr["nlink"] == 0 and ns.getattr(ROOT)["nlink"] == 2
    assert ns.readdir(d) == {"entries": [], "more": False}
    assert code(lambda: ns.mkdir(d, b"x", 0o755, 0, 0)) == errno.ENOENT
    assert code(lambda: ns.mknod(d, b"x", 0o644, 0, 0, 0, no_layout)) == errno.ENOENT
    assert code(lambda: ns.rename(ROOT, b"nothing", d, b"x")) == errno.ENOENT
    fs.file(ROOT, b"f")
    assert code(lambda: ns.rename(ROOT, b"f", d, b"x")) == errno.ENOENT
    assert ns.fsck() == []
    assert ns.release(d, handle, fs.session)
    assert code(lambda: ns.getattr(d)) == errno.ENOENT
    assert ns.gc_jobs() == []


def test_freed_file_drops_its_truncate_job(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")
    ns.update_length(ino, 1 << 22)
    ns.setattr(ino, size=10)
    assert ns.truncate_job(ino) is not None
    ns.unlink(ROOT, b"f")
    assert ns.truncate_job(ino) is None  # GC removes every chunk anyway
    assert [j["ino"] for j in ns.gc_jobs()] == [ino]
    ns.gc_done(ino)


# ---- fsck finds what is wrong --------------------------------------------------------------


def _poke(ns: NamespaceStore, db: bytes, key: bytes, value: bytes | None) -> None:
    with ns.env.begin(write=True) as txn:
        if value is None:
            txn.delete(key, db=ns.dbs[db])
        else:
            txn.put(key, value, db=ns.dbs[db])


def _record(ns: NamespaceStore, ino: int) -> dict[str, Any]:
    with ns.env.begin() as txn:
        rec: dict[str, Any] = msgpack.unpackb(txn.get(u64(ino), db=ns.dbs[b"inodes"]))
        return rec


def test_fsck_finds_damage(ns_path: Path, clock: FakeClock) -> None:
    ns = NamespaceStore(ns_path, map_size=64 << 20, clock=clock)
    try:
        fs_dir = ns.mkdir(ROOT, b"d", 0o755, 0, 0)["ino"]
        f = ns.mknod(fs_dir, b"f", 0o644, 0, 0, 0, lambda: {"chunk_size": 4096, "chains": [1]})
        assert ns.fsck() == []

        rec = _record(ns, f["ino"])
        rec["nlink"] = 2
        _poke(ns, b"inodes", u64(f["ino"]), msgpack.packb(rec))
        assert any("nlink 2 but 1 names" in p for p in ns.fsck())
        rec["nlink"] = 1
        _poke(ns, b"inodes", u64(f["ino"]), msgpack.packb(rec))

        _poke(ns, b"dentries", u64(fs_dir) + b"ghost", u64(999) + b"\x08")
        assert any("missing inode 999" in p for p in ns.fsck())
        _poke(ns, b"dentries", u64(fs_dir) + b"ghost", None)

        _poke(ns, b"dentries", u64(fs_dir) + b"f", None)  # the file loses its only name
        problems = ns.fsck()
        assert any("unreachable" in p for p in problems)
        assert any("nlink 1 but 0 names" in p for p in problems)
        _poke(ns, b"dentries", u64(fs_dir) + b"f", u64(f["ino"]) + b"\x08")
        assert ns.fsck() == []

        droot = _record(ns, ROOT)
        droot["nlink"] = 7
        _poke(ns, b"inodes", u64(ROOT), msgpack.packb(droot))
        assert any("directory 1: nlink 7, expected 3" in p for p in ns.fsck())
        droot["nlink"] = 3
        _poke(ns, b"inodes", u64(ROOT), msgpack.packb(droot))

        _poke(ns, b"counters", b"ino", u64(2))
        assert any("counter ino" in p for p in ns.fsck())
        _poke(ns, b"counters", b"ino", u64(100))

        _poke(ns, b"gc", u64(f["ino"]), msgpack.packb({"layout": {"chains": [1]}, "queued": 0}))
        assert any("gc job for live inode" in p for p in ns.fsck())
        _poke(ns, b"gc", u64(f["ino"]), None)
        assert ns.fsck() == []
    finally:
        ns.close()
