"""POSIX behaviour through the mount, checked against Linux on a local directory.

Each scenario runs once under a local temporary directory (ext4) and once
under the mount, recording every step's value or errno (`oscompare.Trace`);
the two traces must be equal. Key steps are also checked against the value
Linux is documented to give, so a scenario that silently did nothing on both
sides would fail.
"""

from __future__ import annotations

import functools
import mmap
import os
import random
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from oscompare import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    Trace,
    digest,
    renameat2,
    stat_summary,
)

CHUNK = 1 << 20
OLD_NS = 1_000_000_000  # a directory mtime far in the past, to see it move


@pytest.fixture
def dirs(writable_mnt: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A local directory, and the test's through each mount mode that writes."""
    local = tmp_path / "local"
    local.mkdir()
    return local, writable_mnt


def compare(dirs: tuple[Path, Path], scenario: Callable[[Path, Trace], None]) -> dict[str, Any]:
    """Run *scenario* on both sides; the traces must be equal. Returns the
    mount's trace as a dict (step -> value) for spot checks."""
    traces = []
    for base in dirs:
        t = Trace()
        scenario(base, t)
        traces.append(t.log)
    local, mount = traces
    assert mount == local
    steps = [what for what, _ in mount]
    assert len(steps) == len(set(steps)), "scenario step names must be unique"
    return dict(mount)


def read_all(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def pwrite_path(p: Path, data: bytes, offset: int) -> int:
    fd = os.open(p, os.O_WRONLY)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def pread_digest(fd: int, n: int, offset: int) -> str:
    return digest(os.pread(fd, n, offset))


def pread_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size + 10, 0)


# ---- create, open flags -----------------------------------------------------------


def test_create_excl_trunc_append(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "f"
        fd = t.ok("create excl", lambda: os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640))
        t.val("write", lambda: os.write(fd, b"abcdef"))
        os.close(fd)
        t.ok("create excl again", lambda: os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        fd = t.ok("create existing", lambda: os.open(f, os.O_CREAT | os.O_RDWR, 0o600))
        t.val("mode kept", lambda: stat.S_IMODE(os.fstat(fd).st_mode))
        t.val("content kept", lambda: pread_all(fd))
        os.close(fd)
        fd = t.ok("open trunc", lambda: os.open(f, os.O_WRONLY | os.O_TRUNC))
        t.val("size after trunc", lambda: os.fstat(fd).st_size)
        t.val("write after trunc", lambda: os.write(fd, b"hello"))
        os.close(fd)
        t.val("read", lambda: read_all(f))
        fd = t.ok("open append", lambda: os.open(f, os.O_WRONLY | os.O_APPEND))
        os.lseek(fd, 0, os.SEEK_SET)
        t.val("append write", lambda: os.write(fd, b"XY"))
        t.val("append pwrite", lambda: os.pwrite(fd, b"Z", 0))  # Linux appends anyway
        t.val("append position", lambda: os.lseek(fd, 0, os.SEEK_CUR))
        os.close(fd)
        t.val("after append", lambda: read_all(f))
        a = os.open(f, os.O_WRONLY | os.O_APPEND)
        b = os.open(f, os.O_RDWR | os.O_APPEND)
        for i in range(6):
            os.write(a if i % 2 else b, b"%d" % i)
        t.val("two appenders", lambda: pread_all(b))
        os.close(a)
        os.close(b)
        fd = t.ok("rdonly trunc", lambda: os.open(f, os.O_RDONLY | os.O_TRUNC))
        if fd is not None:
            os.close(fd)
        t.val("size after rdonly trunc", lambda: f.stat().st_size)
        t.ok("open missing", lambda: os.open(d / "missing", os.O_RDONLY))
        (d / "dir").mkdir()
        t.ok("creat on dir", lambda: os.open(d / "dir", os.O_CREAT | os.O_WRONLY))
        t.ok("creat excl on dir", lambda: os.open(d / "dir", os.O_CREAT | os.O_EXCL | os.O_RDWR))
        t.ok("O_DIRECTORY on file", lambda: os.open(f, os.O_RDONLY | os.O_DIRECTORY))
        t.ok("trailing slash on file", lambda: os.open(str(f) + "/", os.O_RDONLY))
        t.ok("create under file", lambda: os.open(f / "x", os.O_CREAT | os.O_WRONLY))

    res = compare(dirs, scenario)
    assert res["create excl again"] == "EEXIST"
    assert res["mode kept"] == 0o640
    assert res["after append"] == b"helloXYZ"
    assert res["two appenders"] == b"helloXYZ012345"
    assert res["size after rdonly trunc"] == 0
    assert res["creat on dir"] == "EISDIR"
    assert res["O_DIRECTORY on file"] == "ENOTDIR"
    assert res["create under file"] == "ENOTDIR"


def test_pread_pwrite_odd_offsets(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        rng = random.Random(1234)
        fd = os.open(d / "f", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            for i in range(40):
                off = rng.choice([0, 1, 4095, 4097, CHUNK - 1, CHUNK + 1, 3 * CHUNK - 7])
                off += rng.randrange(0, 300)
                data = rng.randbytes(rng.choice([1, 2, 511, 4096, 70_000, CHUNK + 3]))
                t.val(f"pwrite {i}", functools.partial(os.pwrite, fd, data, off))
                roff = rng.randrange(0, 4 * CHUNK)
                n = rng.choice([1, 3, 4096, CHUNK, 2 * CHUNK + 5])
                t.val(f"pread {i}", functools.partial(pread_digest, fd, n, roff))
                t.val(f"size {i}", lambda: os.fstat(fd).st_size)
            # write()/read() at the file position
            os.lseek(fd, 12345, os.SEEK_SET)
            t.val("write at position", lambda: os.write(fd, b"positional"))
            t.val("position", lambda: os.lseek(fd, 0, os.SEEK_CUR))
            os.lseek(fd, 12340, os.SEEK_SET)
            t.val("read at position", lambda: os.read(fd, 20))
            end = os.lseek(fd, -3, os.SEEK_END)
            t.val("seek end", lambda: end)
            t.val("short read at eof", lambda: os.read(fd, 100))
            t.val("read past eof", lambda: os.read(fd, 100))
            t.val("pread far past eof", lambda: os.pread(fd, 10, 1 << 40))
        finally:
            os.close(fd)
        t.val("whole file", lambda: digest(read_all(d / "f")))

    compare(dirs, scenario)


def test_sparse_files_and_holes(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "sparse"
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            t.val("pwrite far", lambda: os.pwrite(fd, b"end", 3 * CHUNK + 5))
            t.val("size", lambda: os.fstat(fd).st_size)
            t.val("hole at start", lambda: os.pread(fd, 16, 0))
            t.val("hole over a chunk boundary", lambda: os.pread(fd, 8, 2 * CHUNK - 4))
            t.val("tail", lambda: os.pread(fd, 16, 3 * CHUNK))
            t.val("pwrite middle", lambda: os.pwrite(fd, b"mid", CHUNK + 100))
            t.val("around middle", lambda: os.pread(fd, 10, CHUNK + 97))
            t.val("all", lambda: digest(os.pread(fd, 4 * CHUNK, 0)))
        finally:
            os.close(fd)
        t.val("after close", lambda: digest(read_all(f)))
        t.val("stat size", lambda: f.stat().st_size)

    res = compare(dirs, scenario)
    assert res["size"] == 3 * CHUNK + 8
    assert res["hole at start"] == bytes(16)
    assert res["around middle"] == b"\0\0\0mid\0\0\0\0"


def test_truncate_grow_shrink_regrow(dirs: tuple[Path, Path]) -> None:
    data = random.Random(5).randbytes(2 * CHUNK + CHUNK // 2)

    def scenario(d: Path, t: Trace) -> None:
        f = d / "t"
        f.write_bytes(data)
        t.val("shrink", lambda: os.truncate(f, CHUNK + 123))
        t.val("size after shrink", lambda: f.stat().st_size)
        t.val("regrow", lambda: os.truncate(f, 3 * CHUNK))
        content = t.val("content after regrow", lambda: digest(read_all(f)))
        t.note("regrown tail is zeros", read_all(f)[CHUNK + 123 :] == bytes(2 * CHUNK - 123))
        del content
        t.val("truncate to zero", lambda: os.truncate(f, 0))
        t.val("grow from zero", lambda: os.truncate(f, 10))
        t.val("read zeros", lambda: read_all(f))
        t.val("truncate at chunk boundary", lambda: os.truncate(f, CHUNK))
        fd = os.open(f, os.O_RDWR)
        try:
            os.pwrite(fd, data[: 2 * CHUNK], 0)
            t.val("ftruncate shrink", lambda: os.ftruncate(fd, 5))
            t.val("pwrite past new end", lambda: os.pwrite(fd, b"Q", CHUNK + 10))
            t.val("hole after ftruncate", lambda: digest(os.pread(fd, 2 * CHUNK, 0)))
            t.note("cut bytes stay cut", os.pread(fd, CHUNK + 5, 5) == bytes(CHUNK + 5))
            t.val("fstat size", lambda: os.fstat(fd).st_size)
            t.val("ftruncate negative", lambda: os.ftruncate(fd, -1))
        finally:
            os.close(fd)
        (d / "dir").mkdir()
        t.val("truncate dir", lambda: os.truncate(d / "dir", 0))
        t.val("truncate missing", lambda: os.truncate(d / "missing", 0))
        fd = os.open(f, os.O_RDONLY)
        try:
            t.val("ftruncate read-only fd", lambda: os.ftruncate(fd, 0))
        finally:
            os.close(fd)

    res = compare(dirs, scenario)
    assert res["size after shrink"] == CHUNK + 123
    assert res["regrown tail is zeros"] is True
    assert res["cut bytes stay cut"] is True
    assert res["read zeros"] == bytes(10)
    assert res["truncate dir"] == "EISDIR"


def test_writes_visible_to_other_descriptors_before_close(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "w"
        f.write_bytes(b"0123456789")
        w = os.open(f, os.O_RDWR)
        r = os.open(f, os.O_RDONLY)
        try:
            os.pwrite(w, b"abc", 8)
            t.val("reader fstat", lambda: os.fstat(r).st_size)
            t.val("path stat", lambda: f.stat().st_size)
            t.val("reader pread", lambda: os.pread(r, 100, 0))
            r2 = os.open(f, os.O_RDONLY)
            t.val("new reader", lambda: os.pread(r2, 100, 0))
            os.close(r2)
        finally:
            os.close(w)
            os.close(r)

    res = compare(dirs, scenario)
    assert res["reader pread"] == b"01234567abc"


def test_mmap_shared(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "m"
        f.write_bytes(bytes(range(256)) * 64)
        fd = os.open(f, os.O_RDWR)
        try:
            m = t.ok("map rw", lambda: mmap.mmap(fd, 0))
            if m is not None:
                m[10:15] = b"HELLO"
                m.flush()
                t.val("pread sees mapped write", lambda: os.pread(fd, 8, 8))
                os.pwrite(fd, b"world", 100)
                t.val("map sees pwrite", lambda: m[100:105])
                m.close()
        finally:
            os.close(fd)
        fd = os.open(f, os.O_RDWR | os.O_APPEND)
        try:
            m = t.ok("map an O_APPEND descriptor", lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ))
            if m is not None:
                os.write(fd, b"tail")
                t.val("mapped head", lambda: m[8:16])
                m.close()
        finally:
            os.close(fd)
        t.val("file", lambda: digest(f.read_bytes()))

    res = compare(dirs, scenario)
    assert res["pread sees mapped write"] == b"\x08\x09HELLO\x0f"
    assert res["map an O_APPEND descriptor"] == "ok"


# ---- rename -----------------------------------------------------------------------


def test_rename_semantics(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        (d / "a").write_text("A")
        (d / "b").write_text("B")
        (d / "empty").mkdir()
        (d / "empty2").mkdir()
        (d / "full" / "sub").mkdir(parents=True)
        (d / "full" / "sub" / "x").write_text("x")
        t.val("file over file", lambda: os.rename(d / "a", d / "b"))
        t.val("replaced content", lambda: (d / "b").read_text())
        t.val("old name gone", lambda: os.path.lexists(d / "a"))
        t.val("file over empty dir", lambda: os.rename(d / "b", d / "empty"))
        t.val("dir over file", lambda: os.rename(d / "empty", d / "b"))
        t.val("dir over non-empty dir", lambda: os.rename(d / "empty", d / "full"))
        t.val("dir over empty dir", lambda: os.rename(d / "empty", d / "empty2"))
        t.val("after dir over dir", lambda: sorted(os.listdir(d)))
        t.val("into own subtree", lambda: os.rename(d / "full", d / "full" / "sub" / "inner"))
        t.val("onto own ancestor", lambda: os.rename(d / "full" / "sub", d / "full"))
        t.val("onto non-empty ancestor", lambda: os.rename(d / "full" / "sub" / "x", d / "full"))
        t.val("to itself", lambda: os.rename(d / "b", d / "b"))
        t.val("missing source", lambda: os.rename(d / "nope", d / "b2"))
        t.val("into missing dir", lambda: os.rename(d / "b", d / "nope" / "b"))
        t.val("dot", lambda: os.rename(f"{d}/full/.", d / "f2"))
        t.val("under a file", lambda: os.rename(d / "b", d / "b" / "c"))
        # moving a directory across parents moves its '..' and the link counts
        t.val("move dir", lambda: os.rename(d / "full" / "sub", d / "empty2" / "sub"))
        t.val("old parent nlink", lambda: (d / "full").stat().st_nlink)
        t.val("new parent nlink", lambda: (d / "empty2").stat().st_nlink)
        t.val("moved content", lambda: (d / "empty2" / "sub" / "x").read_text())
        t.val("listing", lambda: sorted(os.listdir(d)))

    res = compare(dirs, scenario)
    assert res["replaced content"] == "A"
    assert res["file over empty dir"] == "EISDIR"
    assert res["dir over file"] == "ENOTDIR"
    assert res["dir over non-empty dir"] == "ENOTEMPTY"
    assert res["into own subtree"] == "EINVAL"
    assert res["onto own ancestor"] == "ENOTEMPTY"
    assert res["dot"] == "EBUSY"
    assert res["old parent nlink"] == 2 and res["new parent nlink"] == 3


def test_rename_hardlinks_of_one_inode(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        (d / "f").write_text("same")
        os.link(d / "f", d / "h")
        t.val("rename onto own hardlink", lambda: os.rename(d / "f", d / "h"))
        t.val("both names remain", lambda: sorted(os.listdir(d)))
        t.val("nlink", lambda: (d / "h").stat().st_nlink)
        t.val("noreplace onto own hardlink", lambda: renameat2(d / "f", d / "h", RENAME_NOREPLACE))
        t.val("exchange with own hardlink", lambda: renameat2(d / "f", d / "h", RENAME_EXCHANGE))
        t.val("still both", lambda: sorted(os.listdir(d)))

    res = compare(dirs, scenario)
    assert res["both names remain"] == ["f", "h"]
    assert res["nlink"] == 2


def test_renameat2_noreplace_exchange(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        (d / "f").write_text("F")
        (d / "g").write_text("G")
        (d / "dir").mkdir()
        (d / "dir" / "inside").write_text("I")
        (d / "other").mkdir()
        t.val("noreplace existing", lambda: renameat2(d / "f", d / "g", RENAME_NOREPLACE))
        t.val("noreplace new", lambda: renameat2(d / "f", d / "f2", RENAME_NOREPLACE))
        t.val("names", lambda: sorted(os.listdir(d)))
        t.val("exchange files", lambda: renameat2(d / "f2", d / "g", RENAME_EXCHANGE))
        t.val("f2 now", lambda: (d / "f2").read_text())
        t.val("g now", lambda: (d / "g").read_text())
        t.val("exchange missing", lambda: renameat2(d / "f2", d / "nope", RENAME_EXCHANGE))
        t.val("exchange file and dir", lambda: renameat2(d / "g", d / "dir", RENAME_EXCHANGE))
        t.val("g is dir", lambda: (d / "g").is_dir())
        t.val("dir is file", lambda: (d / "dir").read_text())
        t.val("moved dir content", lambda: (d / "g" / "inside").read_text())
        t.val(
            "exchange across parents",
            lambda: renameat2(d / "g", d / "other" / "x", RENAME_EXCHANGE),
        )
        (d / "other" / "x").write_text("X")
        t.val(
            "exchange dir with file elsewhere",
            lambda: renameat2(d / "g", d / "other" / "x", RENAME_EXCHANGE),
        )
        t.val("nlink top", lambda: d.stat().st_nlink)
        t.val("nlink other", lambda: (d / "other").stat().st_nlink)
        t.val("x is dir", lambda: (d / "other" / "x").is_dir())
        t.val(
            "exchange with own subtree",
            lambda: renameat2(d / "other", d / "other" / "x" / "inside", RENAME_EXCHANGE),
        )
        t.val(
            "both flags", lambda: renameat2(d / "f2", d / "g", RENAME_EXCHANGE | RENAME_NOREPLACE)
        )

    res = compare(dirs, scenario)
    assert res["noreplace existing"] == "EEXIST"
    assert res["f2 now"] == "G" and res["g now"] == "F"
    assert res["exchange missing"] == "ENOENT"
    assert res["moved dir content"] == "I"
    assert res["both flags"] == "EINVAL"


# ---- links ------------------------------------------------------------------------


def test_link_unlink_nlink(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "f"
        f.write_bytes(b"data")
        t.val("nlink 1", lambda: f.stat().st_nlink)
        t.val("link g", lambda: os.link(f, d / "g"))
        t.val("link h", lambda: os.link(d / "g", d / "h"))
        t.val("nlink 3 via h", lambda: (d / "h").stat().st_nlink)
        t.val("nlink 3 via f", lambda: f.stat().st_nlink)
        t.val("link existing", lambda: os.link(f, d / "g"))
        t.val("link missing", lambda: os.link(d / "nope", d / "n2"))
        (d / "dir").mkdir()
        t.val("link dir", lambda: os.link(d / "dir", d / "dir2"))
        t.val("unlink g", lambda: os.unlink(d / "g"))
        t.val("nlink 2", lambda: f.stat().st_nlink)
        fd = os.open(f, os.O_RDWR)
        try:
            t.val("unlink f", lambda: os.unlink(f))
            t.val("unlink h", lambda: os.unlink(d / "h"))
            t.val("fstat nlink 0", lambda: os.fstat(fd).st_nlink)
            t.val("read unlinked", lambda: os.pread(fd, 10, 0))
            t.val("write unlinked", lambda: os.pwrite(fd, b"more", 4))
            t.val("read unlinked again", lambda: os.pread(fd, 10, 0))
        finally:
            os.close(fd)
        t.val("unlink missing", lambda: os.unlink(f))
        t.val("listing", lambda: sorted(os.listdir(d)))
        # a hard link to a symlink (linkat without AT_SYMLINK_FOLLOW)
        os.symlink("target", d / "sl")
        t.val("link symlink", lambda: os.link(d / "sl", d / "sl2", follow_symlinks=False))
        t.val("symlink nlink", lambda: os.lstat(d / "sl2").st_nlink)
        t.val("linked symlink target", lambda: os.readlink(d / "sl2"))

    res = compare(dirs, scenario)
    assert res["nlink 3 via f"] == 3
    assert res["fstat nlink 0"] == 0
    assert res["read unlinked again"] == b"datamore"
    assert res["link dir"] == "EPERM"


def test_symlinks(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        (d / "file").write_text("content")
        (d / "dir").mkdir()
        (d / "dir" / "in").write_text("in")
        t.val("symlink", lambda: os.symlink("file", d / "s"))
        t.val("readlink", lambda: os.readlink(d / "s"))
        t.val("lstat", lambda: stat_summary(os.lstat(d / "s")))
        t.val("stat follows", lambda: stat_summary(os.stat(d / "s")))
        t.val("read through", lambda: (d / "s").read_text())
        t.val("symlink exists", lambda: os.symlink("x", d / "s"))
        t.val("dir symlink", lambda: os.symlink("dir", d / "sd"))
        t.val("list through", lambda: os.listdir(d / "sd"))
        t.val("path through", lambda: (d / "sd" / "in").read_text())
        t.val("readlink on file", lambda: os.readlink(d / "file"))
        t.val("dangling", lambda: os.symlink("gone/../target", d / "dang"))
        t.val("stat dangling", lambda: os.stat(d / "dang"))
        t.val("lstat dangling", lambda: stat_summary(os.lstat(d / "dang")))
        t.val("exists dangling", lambda: (d / "dang").exists())
        t.val("dangling2", lambda: os.symlink("target", d / "dang2"))
        t.ok("open dangling", lambda: os.open(d / "dang2", os.O_RDONLY))
        t.ok("create excl via dangling", lambda: os.open(d / "dang2", os.O_CREAT | os.O_EXCL))
        fd = t.ok("create via dangling", lambda: os.open(d / "dang2", os.O_CREAT | os.O_WRONLY))
        if fd is not None:
            os.write(fd, b"made")
            os.close(fd)
        t.val("target created", lambda: (d / "target").read_text())
        t.val("loop a", lambda: os.symlink("b", d / "a"))
        t.val("loop b", lambda: os.symlink("a", d / "b"))
        t.val("stat loop", lambda: os.stat(d / "a"))
        long_target = "x" * 4095
        t.val("long target", lambda: os.symlink(long_target, d / "long"))
        t.val("long readlink", lambda: len(os.readlink(d / "long")))
        t.val("long lstat size", lambda: os.lstat(d / "long").st_size)
        t.val("too long target", lambda: os.symlink("x" * 4096, d / "toolong"))
        t.val("unlink symlink", lambda: os.unlink(d / "s"))
        t.val("target survives", lambda: (d / "file").read_text())
        t.val("rmdir on dir symlink", lambda: os.rmdir(d / "sd"))
        t.val("listing", lambda: sorted(os.listdir(d)))

    res = compare(dirs, scenario)
    assert res["readlink"] == "file"
    assert res["lstat"] == (oct(stat.S_IFLNK), 0o777, 4, 1)
    assert res["stat dangling"] == "ENOENT"
    assert res["target created"] == "made"
    assert res["stat loop"] == "ELOOP"
    assert res["long lstat size"] == 4095


# ---- extended attributes -----------------------------------------------------------


def xattr_steps(t: Trace, name: str, p: Path) -> None:
    """The xattr calls every regular file and directory must support."""
    t.val(f"{name}: list empty", lambda: os.listxattr(p))
    t.val(f"{name}: get missing", lambda: os.getxattr(p, "user.k"))
    t.val(f"{name}: set", lambda: os.setxattr(p, "user.k", b"v1"))
    t.val(f"{name}: get", lambda: os.getxattr(p, "user.k"))
    t.val(
        f"{name}: create existing",
        lambda: os.setxattr(p, "user.k", b"v2", os.XATTR_CREATE),
    )
    t.val(
        f"{name}: replace missing",
        lambda: os.setxattr(p, "user.m", b"v2", os.XATTR_REPLACE),
    )
    t.val(
        f"{name}: replace existing",
        lambda: os.setxattr(p, "user.k", b"v3", os.XATTR_REPLACE),
    )
    t.val(
        f"{name}: create new",
        lambda: os.setxattr(p, "user.n", b"", os.XATTR_CREATE),
    )
    t.val(f"{name}: empty value", lambda: os.getxattr(p, "user.n"))
    t.val(f"{name}: binary value", lambda: os.setxattr(p, "user.b", bytes(range(256))))
    t.val(f"{name}: get binary", lambda: os.getxattr(p, "user.b"))
    t.val(f"{name}: 3000-byte value", lambda: os.setxattr(p, "user.big", b"v" * 3000))
    t.val(f"{name}: get big", lambda: digest(os.getxattr(p, "user.big")))
    t.val(f"{name}: list", lambda: sorted(os.listxattr(p)))
    t.val(f"{name}: remove", lambda: os.removexattr(p, "user.k"))
    t.val(f"{name}: remove missing", lambda: os.removexattr(p, "user.k"))
    t.val(f"{name}: get removed", lambda: os.getxattr(p, "user.k"))
    t.val(f"{name}: list after", lambda: sorted(os.listxattr(p)))
    t.val(f"{name}: name too long", lambda: os.setxattr(p, "user." + "n" * 251, b""))
    t.val(f"{name}: longest name", lambda: os.setxattr(p, "user." + "n" * 250, b"L"))
    t.val(f"{name}: unknown namespace", lambda: os.setxattr(p, "bogus.k", b""))
    t.val(f"{name}: trusted", lambda: os.setxattr(p, "trusted.k", b"t"))
    t.val(f"{name}: get trusted", lambda: os.getxattr(p, "trusted.k"))


def test_xattr_semantics(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "f"
        f.write_text("x")
        (d / "dir").mkdir()
        os.symlink("f", d / "sl")
        os.mkfifo(d / "fifo")
        xattr_steps(t, "file", f)
        xattr_steps(t, "dir", d / "dir")
        t.val(
            "symlink: lset user",
            lambda: os.setxattr(d / "sl", "user.k", b"", follow_symlinks=False),
        )
        t.val("symlink: follows", lambda: os.getxattr(d / "sl", "user.n"))
        t.val("fifo: set user", lambda: os.setxattr(d / "fifo", "user.k", b""))
        t.val("fifo: get user", lambda: os.getxattr(d / "fifo", "user.k"))
        t.val("missing file", lambda: os.getxattr(d / "nope", "user.k"))
        # the kernel reads security.capability before every write; the mount
        # remembers its absence, which a set must end at once
        caps = b"\x01\x00\x00\x02" + bytes(16)  # VFS_CAP_REVISION_2, no capabilities
        t.val("caps before", lambda: os.getxattr(f, "security.capability"))
        t.val("write without caps", lambda: pwrite_path(f, b"w", 0))
        t.val("set caps", lambda: os.setxattr(f, "security.capability", caps))
        t.val("caps after set", lambda: os.getxattr(f, "security.capability"))
        t.val("remove caps", lambda: os.removexattr(f, "security.capability"))
        t.val("caps after remove", lambda: os.getxattr(f, "security.capability"))
        os.link(f, d / "hard")
        t.val("via hard link", lambda: os.getxattr(d / "hard", "user.b") == bytes(range(256)))
        os.rename(f, d / "renamed")
        t.val("after rename", lambda: sorted(os.listxattr(d / "renamed")))

    res = compare(dirs, scenario)
    assert res["file: get"] == b"v1"
    assert res["file: create existing"] == "EEXIST"
    assert res["file: replace missing"] == "ENODATA"
    assert res["dir: get missing"] == "ENODATA"
    assert res["file: remove missing"] == "ENODATA"
    assert res["file: list"] == ["user.b", "user.big", "user.k", "user.n"]
    assert res["symlink: lset user"] == "EPERM"
    assert res["caps before"] == res["caps after remove"] == "ENODATA"
    assert res["caps after set"] == b"\x01\x00\x00\x02" + bytes(16)


# ---- attributes ---------------------------------------------------------------------


def test_chmod_chown(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "f"
        f.write_text("x")
        (d / "dir").mkdir()
        os.symlink("f", d / "sl")
        for mode in (0o600, 0o7777, 0o4755, 0o2710, 0o1000, 0):
            t.val(f"chmod {mode:o}", functools.partial(os.chmod, f, mode))
            t.val(f"mode {mode:o}", lambda: stat_summary(f.stat()))
        t.val("chmod dir", lambda: os.chmod(d / "dir", 0o1777))
        t.val("dir mode", lambda: stat_summary((d / "dir").stat()))
        t.val("chown", lambda: os.chown(f, 1234, 5678))
        t.val("owner", lambda: (f.stat().st_uid, f.stat().st_gid))
        t.val("chown gid only", lambda: os.chown(f, -1, 42))
        t.val("owner gid only", lambda: (f.stat().st_uid, f.stat().st_gid))
        # chown clears set-user-ID (and set-group-ID with group exec) of a file
        t.val("chmod 6755", lambda: os.chmod(f, 0o6755))
        t.val("chown clears suid", lambda: os.chown(f, 1, 1))
        t.val("mode after chown", lambda: oct(f.stat().st_mode))
        t.val("chmod 2745", lambda: os.chmod(f, 0o2745))
        t.val("chown keeps sgid without gx", lambda: os.chown(f, 2, 2))
        t.val("mode after chown 2", lambda: oct(f.stat().st_mode))
        t.val("lchown", lambda: os.chown(d / "sl", 77, 88, follow_symlinks=False))
        t.val("symlink owner", lambda: (os.lstat(d / "sl").st_uid, os.lstat(d / "sl").st_gid))
        t.val("target owner", lambda: (f.stat().st_uid, f.stat().st_gid))
        t.val("chmod missing", lambda: os.chmod(d / "nope", 0o644))
        t.val("chown dir", lambda: os.chown(d / "dir", 9, 9))
        t.val("dir owner", lambda: ((d / "dir").stat().st_uid, (d / "dir").stat().st_gid))

    res = compare(dirs, scenario)
    assert res["owner"] == (1234, 5678)
    assert res["owner gid only"] == (1234, 42)
    assert res["mode 7777"] == (oct(stat.S_IFREG), 0o7777, 1, 1)
    assert res["mode after chown"] == oct(stat.S_IFREG | 0o755)


def test_utime(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        f = d / "f"
        f.write_text("x")
        os.symlink("f", d / "sl")
        t.val("set ns", lambda: os.utime(f, ns=(1_000_000_123, 2_000_000_456)))
        t.val("times", lambda: (f.stat().st_atime_ns, f.stat().st_mtime_ns))
        t.val("pre-epoch", lambda: os.utime(f, ns=(-5_000_000_000, -1_500_000_000)))
        t.val("pre-epoch times", lambda: (f.stat().st_atime_ns, f.stat().st_mtime_ns))
        before = time.time_ns()
        t.val("utime now", lambda: os.utime(f))
        st = f.stat()
        t.note("atime is now", before - 2e9 <= st.st_atime_ns <= time.time_ns() + 2e9)
        t.note("mtime is now", before - 2e9 <= st.st_mtime_ns <= time.time_ns() + 2e9)
        t.note("ctime is now", before - 2e9 <= st.st_ctime_ns <= time.time_ns() + 2e9)
        t.val("symlink times", lambda: os.utime(d / "sl", ns=(7, 8), follow_symlinks=False))
        t.val("symlink has them", lambda: os.lstat(d / "sl").st_mtime_ns)
        t.val("target untouched", lambda: f.stat().st_mtime_ns == 8)
        t.val("utime missing", lambda: os.utime(d / "nope"))
        fd = os.open(f, os.O_RDWR)
        try:
            t.val("futimens", lambda: os.utime(fd, ns=(3_000_000_000, 4_000_000_000)))
            t.val("fstat times", lambda: os.fstat(fd).st_mtime_ns)
            os.pwrite(fd, b"later", 0)
            t.note("write moves mtime", os.fstat(fd).st_mtime_ns > 4_000_000_000)
        finally:
            os.close(fd)
        t.note("mtime after close", f.stat().st_mtime_ns > 4_000_000_000)
        g = d / "g"
        with open(g, "wb") as w:  # cp -p: times set on the open file after its writes
            w.write(b"y" * 300_000)
            os.utime(w.fileno(), ns=(5_000_000_000, 6_000_000_000))
        t.val("cp -p times kept", lambda: (g.stat().st_mtime_ns, g.stat().st_size))
        h = d / "h"
        h.write_bytes(b"z" * 300_000)
        os.utime(h, ns=(7_000_000_000, 8_000_000_000))  # tar x: after the close
        t.val("tar x times kept", lambda: (h.stat().st_mtime_ns, h.stat().st_size))

    res = compare(dirs, scenario)
    assert res["times"] == (1_000_000_123, 2_000_000_456)
    assert res["mtime is now"] is True and res["atime is now"] is True
    assert res["write moves mtime"] is True
    assert res["cp -p times kept"] == (6_000_000_000, 300_000)
    assert res["tar x times kept"] == (8_000_000_000, 300_000)


def test_directory_nlink_and_modes(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        top = d / "top"
        t.val("mkdir", lambda: top.mkdir(0o755))
        t.val("new dir", lambda: stat_summary(top.stat()))
        (top / "a").mkdir()
        (top / "b").mkdir()
        t.val("two subdirs", lambda: top.stat().st_nlink)
        (top / "f").write_bytes(b"12345")
        os.symlink("a", top / "s")
        t.val("files do not count", lambda: top.stat().st_nlink)
        t.val("file", lambda: stat_summary((top / "f").stat()))
        t.val("symlink", lambda: stat_summary(os.lstat(top / "s")))
        t.val("subdir", lambda: stat_summary((top / "a").stat()))
        t.val("rmdir a", lambda: os.rmdir(top / "a"))
        t.val("after rmdir", lambda: top.stat().st_nlink)
        t.val("move b out", lambda: os.rename(top / "b", d / "b"))
        t.val("after move", lambda: (top.stat().st_nlink, d.stat().st_nlink))
        t.val("mkdir mode 0o700", lambda: (top / "p").mkdir(0o700))
        t.val("private dir", lambda: stat_summary((top / "p").stat()))
        t.val("mkdir existing", lambda: top.mkdir())
        t.val("mkdir over file", lambda: (top / "f").mkdir())
        t.val("mkdir in missing", lambda: (d / "nope" / "x").mkdir())
        t.val("mkdir under file", lambda: (top / "f" / "x").mkdir())

    res = compare(dirs, scenario)
    assert res["two subdirs"] == 4
    assert res["after rmdir"] == 3
    assert res["file"] == (oct(stat.S_IFREG), 0o644, 5, 1)


def test_directory_mtime_moves(dirs: tuple[Path, Path]) -> None:
    """Creating or removing a name updates the directory's mtime (the kernel
    drops its cached attributes of the parent, so a stat sees it at once)."""

    def scenario(d: Path, t: Trace) -> None:
        sub = d / "sub"
        sub.mkdir()
        other = d / "other"
        other.mkdir()
        ops: list[tuple[str, Callable[[], Any]]] = [
            ("create", lambda: (sub / "f").write_text("x")),
            ("mkdir", lambda: (sub / "d").mkdir()),
            ("symlink", lambda: os.symlink("f", sub / "s")),
            ("link", lambda: os.link(sub / "f", sub / "h")),
            ("mkfifo", lambda: os.mkfifo(sub / "p")),
            ("rename within", lambda: os.rename(sub / "h", sub / "h2")),
            ("rename out", lambda: os.rename(sub / "h2", other / "h2")),
            ("rename in", lambda: os.rename(other / "h2", sub / "h3")),
            ("unlink", lambda: os.unlink(sub / "h3")),
            ("rmdir", lambda: os.rmdir(sub / "d")),
        ]
        for what, op in ops:
            os.utime(sub, ns=(OLD_NS, OLD_NS))
            start = time.time_ns()
            t.val(what, op)
            st = sub.stat()
            t.note(f"{what}: mtime moved", st.st_mtime_ns > start - 2_000_000_000)
        os.utime(sub, ns=(OLD_NS, OLD_NS))
        (sub / "f").write_text("rewritten")
        t.note("writing a file leaves its directory", sub.stat().st_mtime_ns == OLD_NS)

    res = compare(dirs, scenario)
    assert all(v is True for k, v in res.items() if k.endswith("moved"))
    assert res["writing a file leaves its directory"] is True


def test_special_files(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        t.val("mkfifo", lambda: os.mkfifo(d / "fifo", 0o640))
        t.val("fifo stat", lambda: stat_summary(os.stat(d / "fifo")))
        fd = t.ok("open fifo", lambda: os.open(d / "fifo", os.O_RDWR | os.O_NONBLOCK))
        if fd is not None:
            t.val("fifo write", lambda: os.write(fd, b"ping"))
            t.val("fifo read", lambda: os.read(fd, 10))
            os.close(fd)
        t.val("mkfifo existing", lambda: os.mkfifo(d / "fifo"))
        t.val("mknod chr", lambda: os.mknod(d / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3)))
        t.val("chr stat", lambda: stat_summary(os.stat(d / "chr")))
        t.val("chr rdev", lambda: os.stat(d / "chr").st_rdev == os.makedev(1, 3))
        t.val("mknod sock", lambda: os.mknod(d / "sock", stat.S_IFSOCK | 0o644))
        t.val("sock stat", lambda: stat_summary(os.stat(d / "sock")))
        t.val("mknod reg", lambda: os.mknod(d / "reg", stat.S_IFREG | 0o600))
        t.val("reg stat", lambda: stat_summary(os.stat(d / "reg")))
        t.val("reg writable", lambda: (d / "reg").write_bytes(b"abc"))
        t.val("reg content", lambda: (d / "reg").read_bytes())
        t.val("unlink fifo", lambda: os.unlink(d / "fifo"))
        t.val("listing", lambda: sorted(os.listdir(d)))

    res = compare(dirs, scenario)
    assert res["fifo stat"] == (oct(stat.S_IFIFO), 0o640, 0, 1)
    assert res["fifo read"] == b"ping"
    assert res["chr rdev"] is True


# ---- errors ------------------------------------------------------------------------


def test_error_paths(dirs: tuple[Path, Path]) -> None:
    def scenario(d: Path, t: Trace) -> None:
        (d / "dir" / "sub").mkdir(parents=True)
        (d / "file").write_text("x")
        long = "n" * 256
        ok = "n" * 255
        t.val("create 256", lambda: os.close(os.open(d / long, os.O_CREAT | os.O_WRONLY)))
        t.val("stat 256", lambda: os.stat(d / long))
        t.val("mkdir 256", lambda: os.mkdir(d / long))
        t.val("symlink 256", lambda: os.symlink("x", d / long))
        t.val("link 256", lambda: os.link(d / "file", d / long))
        t.val("rename to 256", lambda: os.rename(d / "file", d / long))
        t.val("create 255", lambda: os.close(os.open(d / ok, os.O_CREAT | os.O_WRONLY)))
        t.val("stat 255", lambda: stat_summary(os.stat(d / ok)))
        t.val("listing with 255", lambda: sorted(os.listdir(d)))
        t.val("stat missing", lambda: os.stat(d / "missing"))
        t.val("stat in missing", lambda: os.stat(d / "missing" / "x"))
        t.val("stat under file", lambda: os.stat(d / "file" / "x"))
        t.val("listdir file", lambda: os.listdir(d / "file"))
        t.val("listdir missing", lambda: os.listdir(d / "missing"))
        t.val("rmdir non-empty", lambda: os.rmdir(d / "dir"))
        t.val("rmdir file", lambda: os.rmdir(d / "file"))
        t.val("rmdir missing", lambda: os.rmdir(d / "missing"))
        t.val("rmdir dot", lambda: os.rmdir(f"{d}/dir/sub/."))
        t.val("unlink dir", lambda: os.unlink(d / "dir"))
        t.val("open dir for write", lambda: os.open(d / "dir", os.O_WRONLY))
        t.val("open dir rdwr", lambda: os.open(d / "dir", os.O_RDWR))
        fd = t.ok("open dir read", lambda: os.open(d / "dir", os.O_RDONLY))
        if fd is not None:
            t.val("read dir", lambda: os.read(fd, 10))
            os.close(fd)
        t.val("chdir file", lambda: os.chdir(d / "file"))

    res = compare(dirs, scenario)
    assert res["create 256"] == "ENAMETOOLONG"
    assert res["stat 256"] == "ENAMETOOLONG"
    assert res["stat in missing"] == "ENOENT"
    assert res["stat under file"] == "ENOTDIR"
    assert res["rmdir non-empty"] == "ENOTEMPTY"
    assert res["unlink dir"] == "EISDIR"
    assert res["open dir for write"] == "EISDIR"
    assert res["read dir"] == "EISDIR"
    assert res["rmdir dot"] == "EINVAL"


# ---- readdir ------------------------------------------------------------------------


def test_readdir_large_directory(mnt: Path) -> None:
    d = mnt / "big"
    d.mkdir()
    names = {f"entry-{i:05d}-{'x' * (i % 40)}" for i in range(3000)}
    for name in names:
        os.mknod(d / name)
    listed = os.listdir(d)
    assert len(listed) == len(names)
    assert set(listed) == names
    with os.scandir(d) as it:
        kinds = {e.name: (e.is_file(follow_symlinks=False), e.is_dir()) for e in it}
    assert kinds == {n: (True, False) for n in names}
    assert d.stat().st_nlink == 2
    # remove every tenth entry (each removal is a durable metadata commit) and list again
    gone = set(sorted(names)[::10])
    for name in gone:
        os.unlink(d / name)
    assert sorted(os.listdir(d)) == sorted(names - gone)


def test_readdir_types(mnt: Path) -> None:
    (mnt / "f").write_text("x")
    (mnt / "d").mkdir()
    os.symlink("f", mnt / "s")
    os.mkfifo(mnt / "p")
    with os.scandir(mnt) as it:
        kinds = {
            e.name: (
                e.is_file(follow_symlinks=False),
                e.is_dir(follow_symlinks=False),
                e.is_symlink(),
            )
            for e in it
        }
    assert kinds == {
        "f": (True, False, False),
        "d": (False, True, False),
        "s": (False, False, True),
        "p": (False, False, False),
    }


def test_readdir_while_creating(mnt: Path) -> None:
    """Entries created during a listing: none listed twice, and none of those
    that existed throughout left out."""
    d = mnt / "busy"
    d.mkdir()
    before = {f"m{i:04d}" for i in range(1000)}
    for name in before:
        os.mknod(d / name)
    stop = threading.Event()
    created: list[str] = []

    def creator(round_: int) -> None:
        i = 0
        while not stop.is_set() and i < 1000:
            # names sorting before, among and after the existing ones
            name = ("a", "m", "z")[i % 3] + f"{round_}-{i:04d}-new"
            os.mknod(d / name)
            created.append(name)
            i += 1

    for round_ in range(3):
        thread = threading.Thread(target=creator, args=(round_,))
        thread.start()
        try:
            seen: list[str] = []
            with os.scandir(d) as it:
                for n, entry in enumerate(it):
                    seen.append(entry.name)
                    if n % 97 == 0:  # and some from this thread, between getdents calls
                        name = f"{('b', 'n', 'y')[n % 3]}{round_}-{n:05d}-inline"
                        os.mknod(d / name)
                        created.append(name)
        finally:
            stop.set()
            thread.join()
            stop.clear()
        assert len(seen) == len(set(seen)), "an entry was listed twice"
        assert before <= set(seen), f"missing: {sorted(before - set(seen))[:5]}"
        assert set(seen) <= before | set(created)
    assert set(os.listdir(d)) == before | set(created)
