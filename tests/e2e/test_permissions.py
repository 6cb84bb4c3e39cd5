"""Permissions for an unprivileged user, through the mount and on a local directory.

The mount uses ``default_permissions`` (the kernel checks modes against the
attributes the filesystem reports) and ``allow_other`` (other users may use a
mount root made). A forked child drops to uid/gid 65534 and runs the same
steps under both directories; the traces must be equal, and the key steps
must give what Linux gives.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oscompare import Trace

NOBODY = 65534


def as_nobody(cwd: Path, steps: Callable[[Trace], None]) -> list[Any]:
    """Run *steps* in a forked child with uid = gid = 65534 and no
    supplementary groups, inside *cwd* (entered while still root, so the
    0700 ancestors of pytest's temporary directories do not stand in the way)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(read_end)
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.umask(0o022)
            t = Trace()
            steps(t)
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(t.log, out)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child failed"
    log: list[Any] = pickle.loads(data)
    return log


def prepare(d: Path) -> None:
    """As root: files and directories of every kind of access."""
    os.chmod(d, 0o755)
    (d / "secret").write_bytes(b"root only")
    os.chmod(d / "secret", 0o600)
    (d / "public").write_bytes(b"everyone reads")
    os.chmod(d / "public", 0o644)
    (d / "closed").mkdir(0o755)
    (d / "open").mkdir()
    os.chmod(d / "open", 0o777)
    (d / "sticky").mkdir()
    os.chmod(d / "sticky", 0o1777)
    (d / "sticky" / "rootfile").write_bytes(b"shared")
    os.chmod(d / "sticky" / "rootfile", 0o666)
    (d / "private").mkdir(0o700)
    (d / "private" / "f").write_bytes(b"hidden")
    (d / "group").write_bytes(b"group")
    os.chown(d / "group", 0, NOBODY)
    os.chmod(d / "group", 0o640)
    (d / "mine").write_bytes(b"given away")
    os.chown(d / "mine", NOBODY, NOBODY)
    os.chmod(d / "mine", 0o644)


def steps(t: Trace) -> None:
    def read(p: str) -> bytes:
        with open(p, "rb") as f:
            return f.read()

    def write(p: str, data: bytes, mode: str = "wb") -> int:
        with open(p, mode) as f:
            return f.write(data)

    def create(p: str) -> None:
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o666))

    def owner(p: str) -> tuple[int, int, str]:
        st = os.lstat(p)
        return st.st_uid, st.st_gid, oct(stat.S_IMODE(st.st_mode))

    t.val("access secret", lambda: os.access("secret", os.R_OK))
    t.val("access public", lambda: (os.access("public", os.R_OK), os.access("public", os.W_OK)))
    t.val("read secret", lambda: read("secret"))
    t.val("read public", lambda: read("public"))
    t.val("read group file", lambda: read("group"))
    t.val("write public", lambda: os.open("public", os.O_WRONLY))
    t.val("truncate public", lambda: os.truncate("public", 0))
    t.val("create in closed dir", lambda: create("closed/new"))
    t.val("mkdir in closed dir", lambda: os.mkdir("closed/sub"))
    t.val("unlink in closed dir", lambda: os.unlink("public"))
    t.val("rename in closed dir", lambda: os.rename("public", "public2"))
    t.val("create in open dir", lambda: create("open/made"))
    t.val("owner of new file", lambda: owner("open/made"))
    t.val("mkdir in open dir", lambda: os.mkdir("open/madedir"))
    t.val("owner of new dir", lambda: owner("open/madedir"))
    t.val("symlink in open dir", lambda: os.symlink("made", "open/link"))
    t.val("owner of new symlink", lambda: owner("open/link"))
    t.val("write own file", lambda: write("open/made", b"mine"))
    t.val("read own file", lambda: read("open/made"))
    t.val("chmod own file", lambda: os.chmod("open/made", 0o600))
    t.val("chmod root file", lambda: os.chmod("public", 0o666))
    t.val("chown own file to root", lambda: os.chown("open/made", 0, 0))
    t.val("chgrp to a group not held", lambda: os.chown("open/made", -1, 0))
    t.val("utime now on root file", lambda: os.utime("public"))
    t.val("utime set on root file", lambda: os.utime("public", ns=(1, 1)))
    t.val("utime set on own file", lambda: os.utime("open/made", ns=(5, 5)))
    t.val("setxattr on root file", lambda: os.setxattr("public", "user.k", b"v"))
    t.val("setxattr on own file", lambda: os.setxattr("open/made", "user.k", b"v"))
    t.val("getxattr on secret", lambda: os.getxattr("secret", "user.k"))
    t.val("list private", lambda: os.listdir("private"))
    t.val("stat in private", lambda: os.stat("private/f").st_size)
    t.val("unlink root file in sticky dir", lambda: os.unlink("sticky/rootfile"))
    t.val("write root file in sticky dir", lambda: write("sticky/rootfile", b"+", "ab"))
    t.val("create in sticky dir", lambda: create("sticky/theirs"))
    t.val("unlink own file in sticky dir", lambda: os.unlink("sticky/theirs"))
    t.val("move own file out of open dir", lambda: os.rename("open/made", "closed/made"))
    t.val("chmod own file to 000", lambda: os.chmod("open/made", 0))
    t.val("owner may not read a 000 file", lambda: read("open/made"))
    t.val("given file", lambda: read("mine"))
    t.val("unlink given file in root dir", lambda: os.unlink("mine"))
    t.val("rmdir root dir in open dir", lambda: os.rmdir("closed"))


def test_unprivileged_user(mnt: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    traces = []
    for d in (local, mnt):
        prepare(d)
        traces.append(as_nobody(d, steps))
    local_trace, mount_trace = traces
    assert mount_trace == local_trace
    res = dict(mount_trace)
    assert res["read secret"] == "EACCES"
    assert res["access secret"] is False and res["access public"] == (True, False)
    assert res["read public"] == b"everyone reads"
    assert res["create in closed dir"] == "EACCES"
    assert res["mkdir in closed dir"] == "EACCES"
    assert res["owner of new file"] == (NOBODY, NOBODY, "0o644")
    assert res["owner of new dir"] == (NOBODY, NOBODY, "0o755")
    assert res["chmod root file"] == "EPERM"
    assert res["unlink root file in sticky dir"] == "EPERM"
    assert res["owner may not read a 000 file"] == "EACCES"
    # the root-owned files are untouched
    assert (mnt / "public").read_bytes() == b"everyone reads"
    assert (mnt / "secret").stat().st_mode & 0o777 == 0o600


def test_root_made_files_keep_their_owner(mnt: Path) -> None:
    """A file root creates in a directory nobody owns still belongs to root
    (uid/gid come from the caller, not the directory)."""
    os.chmod(mnt, 0o777)
    os.chown(mnt, NOBODY, NOBODY)
    (mnt / "f").write_text("x")
    st = (mnt / "f").stat()
    assert (st.st_uid, st.st_gid) == (0, 0)


def test_setgid_directory_hands_down_its_group(mnt: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()

    def inside(t: Trace) -> None:
        t.val("create", lambda: os.close(os.open("shared/f", os.O_CREAT | os.O_WRONLY, 0o644)))
        t.val("file group", lambda: os.stat("shared/f").st_gid)
        t.val("mkdir", lambda: os.mkdir("shared/sub"))
        t.val(
            "dir group and mode",
            lambda: (os.stat("shared/sub").st_gid, oct(os.stat("shared/sub").st_mode)),
        )

    traces = []
    for d in (local, mnt):
        os.chmod(d, 0o755)
        (d / "shared").mkdir()
        os.chown(d / "shared", NOBODY, 4242)
        os.chmod(d / "shared", 0o2775)
        traces.append(as_nobody(d, inside))
    assert traces[1] == traces[0]
    assert dict(traces[1])["file group"] == 4242
