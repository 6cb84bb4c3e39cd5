"""`create_files`: many creates in one call. Each file is created (or, as
`create` does, an existing one opened and cut with O_TRUNC) on its own: one
that fails is answered its error while the others stand; the whole call is
one group commit; a retried call (same request id) is answered, not applied
again; an expired session fails the whole call before anything is made; too
many files is E2BIG and a wrongly typed one EINVAL."""

from __future__ import annotations

import errno
import os

import pytest
from metaservice import Env

from shufflefs.metadata.protocol import READDIR_MAX, ROOT_INODE, SESSION_EXPIRED, NewFile
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError

ROOT = ROOT_INODE
NEW = os.O_CREAT | os.O_EXCL | os.O_WRONLY


def new(name: bytes, flags: int = NEW, parent: int = ROOT, mode: int = 0o640) -> NewFile:
    return {"parent": parent, "name": name, "mode": mode, "flags": flags, "uid": 7, "gid": 8}


async def test_each_create_on_its_own_in_one_commit(env: Env) -> None:
    old, handle = await env.create(ROOT, b"old")
    await env.meta.update_length(old, 5000)
    await env.meta.release(old, handle, env.session)
    commits = env.store.txns.commit_count
    created = await env.meta.create_files(
        [
            new(b"a"),
            new(b"old"),  # O_EXCL on a name that is there: EEXIST
            new(b"x" * 256),  # a name over 255 bytes: ENAMETOOLONG
            new(b"c", parent=999_999),  # no such directory
            new(b"old", os.O_CREAT | os.O_TRUNC | os.O_WRONLY),  # opened and cut
            new(b"b", mode=0o600),
        ],
        env.session,
    )
    # one for the creates, one for the cut of `old` carried out after them
    assert env.store.txns.commit_count == commits + 2
    errors = [None if c["error"] is None else c["error"][0] for c in created]
    assert errors == [None, errno.EEXIST, errno.ENAMETOOLONG, errno.ENOENT, None, None]
    a, opened_old, b = created[0]["opened"], created[4]["opened"], created[5]["opened"]
    assert a is not None and opened_old is not None and b is not None
    assert a.get("created") and b.get("created") and not opened_old.get("created")
    assert (a["attr"]["mode"], a["attr"]["uid"], a["attr"]["gid"]) == (0o100640, 7, 8)
    assert b["attr"]["mode"] == 0o100600 and a["layout"] is not None
    assert opened_old["attr"]["ino"] == old and opened_old["attr"]["size"] == 0
    for name, opened in ((b"a", a), (b"b", b)):
        assert (await env.meta.lookup(ROOT, name))["ino"] == opened["attr"]["ino"]
    assert (await env.meta.getattr(old))["size"] == 0
    with pytest.raises(FsError) as info:
        await env.meta.lookup(ROOT, b"c")
    assert info.value.code == errno.ENOENT
    for opened in (a, opened_old, b):  # each holds a handle of its own
        await env.meta.release(opened["attr"]["ino"], opened["handle"], env.session)


async def test_a_retry_is_answered_not_applied_again(env: Env) -> None:
    once = MetaStub(env.meta.rpc, env.meta.address, request=[9, 2])
    commits = env.store.txns.commit_count
    first = await once.create_files([new(b"a"), new(b"b")], env.session)
    assert env.store.txns.commit_count == commits + 1
    again = await once.create_files([new(b"a"), new(b"b")], env.session)  # a lost reply
    assert again == first and [c["error"] for c in again] == [None, None]
    other = await env.meta.create_files([new(b"a")], env.session)  # a new call: EEXIST
    assert other[0]["error"] is not None and other[0]["error"][0] == errno.EEXIST


async def test_an_expired_session_fails_the_whole_call(env: Env) -> None:
    with pytest.raises(FsError) as info:
        await env.meta.create_files([new(b"a"), new(b"b")], 123_456)
    assert info.value.code == SESSION_EXPIRED
    for name in (b"a", b"b"):
        with pytest.raises(FsError):
            await env.meta.lookup(ROOT, name)


async def test_too_many_files_or_a_bad_one_is_refused(env: Env) -> None:
    with pytest.raises(FsError) as info:
        await env.meta.create_files([new(b"a")] * (READDIR_MAX + 1), env.session)
    assert info.value.code == errno.E2BIG
    with pytest.raises(FsError) as info:  # a wrongly typed field: refused whole
        await env.meta.create_files(
            [new(b"a"), {**new(b"b"), "mode": "rw"}],  # type: ignore[list-item]
            env.session,
        )
    assert info.value.code == errno.EINVAL
    with pytest.raises(FsError):
        await env.meta.lookup(ROOT, b"a")
