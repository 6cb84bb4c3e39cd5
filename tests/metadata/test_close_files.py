"""`close_files`: many written files' closes in one call. Each file's length
report then its release; a file that fails is answered its error while the
others stand, and its handle is given back all the same; a retried call
(same request id) is answered, not applied again; too many files is E2BIG."""

from __future__ import annotations

import errno

import pytest
from metaservice import Env

from shufflefs.metadata.protocol import READDIR_MAX, ROOT_INODE, WrittenClose
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError

ROOT = ROOT_INODE


def close(ino: int, handle: int, length: int | None, mtime: int | None = None) -> WrittenClose:
    return {"ino": ino, "handle": handle, "length": length, "mtime": mtime}


async def test_each_close_on_its_own_in_one_call(env: Env) -> None:
    a, ha = await env.create(ROOT, b"a")
    b, hb = await env.create(ROOT, b"b")
    d = (await env.meta.mkdir(ROOT, b"d", 0o755, 0, 0))["ino"]
    _, hd = await env.create(d, b"in-d")
    handles = env.store.read_only.count()
    closed = await env.meta.close_files(
        [
            close(a, ha, 1000, 5_000_000_000),
            close(d, hd, 10),  # a directory has no length: EISDIR, its handle goes back
            close(b, hb, None),  # no report: only the release
        ],
        env.session,
    )
    assert closed[0]["error"] is None and closed[0]["attr"] is not None
    assert (closed[0]["attr"]["size"], closed[0]["attr"]["mtime"]) == (1000, 5_000_000_000)
    assert closed[1]["error"] is not None and closed[1]["error"][0] == errno.EISDIR
    assert closed[2] == {"attr": None, "error": None}
    assert env.store.read_only.count() == handles - 3  # every handle given back
    assert (await env.meta.getattr(a))["size"] == 1000
    assert (await env.meta.getattr(b))["size"] == 0


async def test_a_retry_is_answered_not_applied_again(env: Env) -> None:
    a, ha = await env.create(ROOT, b"a")
    once = MetaStub(env.meta.rpc, env.meta.address, request=[9, 1])
    first = await once.close_files([close(a, ha, 100)], env.session)
    await env.meta.update_length(a, 200)  # a later writer's report
    again = await once.close_files([close(a, ha, 100)], env.session)  # a lost reply, retried
    assert again == first and again[0]["attr"] is not None
    assert again[0]["attr"]["size"] == 100
    assert (await env.meta.getattr(a))["size"] == 200


async def test_too_many_files_or_a_bad_one_is_refused(env: Env) -> None:
    with pytest.raises(FsError) as info:
        await env.meta.close_files([close(1, 1, None)] * (READDIR_MAX + 1), env.session)
    assert info.value.code == errno.E2BIG
    with pytest.raises(FsError) as info:  # a wrongly typed field: refused whole
        await env.meta.close_files([{"ino": "x", "handle": 1}], env.session)  # type: ignore[list-item]
    assert info.value.code == errno.EINVAL
    a, ha = await env.create(ROOT, b"a")
    closed = await env.meta.close_files([close(a, ha, -1)], env.session)  # a negative length
    assert closed[0]["error"] is not None and closed[0]["error"][0] == errno.EINVAL
    assert (await env.meta.getattr(a))["size"] == 0


async def test_attributes_set_behind_apply_after_the_length_and_a_bad_one_fails_its_file(
    env: Env,
) -> None:
    """A writeback mount's chmod, chown and utime of an open file come with
    its close (`attrs`): set after the length report (its mtime over the
    writes'); a value the server refuses fails that file's close alone, and
    its handle is given back all the same."""
    a, ha = await env.create(ROOT, b"a")
    b, hb = await env.create(ROOT, b"b")
    handles = env.store.read_only.count()
    good = close(a, ha, 500, 9_000_000_000)
    good["attrs"] = {"mode": 0o600, "uid": 7, "gid": 8, "atime": 3, "mtime": 4}
    bad = close(b, hb, None)
    bad["attrs"] = {"uid": 1 << 40}
    closed = await env.meta.close_files([good, bad], env.session)
    attr = closed[0]["attr"]
    assert closed[0]["error"] is None and attr is not None
    assert (attr["mode"], attr["uid"], attr["gid"]) == (0o100600, 7, 8)
    assert (attr["size"], attr["atime"], attr["mtime"]) == (500, 3, 4)
    assert (await env.meta.getattr(a))["mode"] == 0o100600
    assert closed[1]["error"] is not None and closed[1]["error"][0] == errno.EINVAL
    assert (await env.meta.getattr(b))["uid"] != 1 << 40
    assert env.store.read_only.count() == handles - 2
    with pytest.raises(FsError) as info:  # a field setattr does not have: refused whole
        await env.meta.close_files(
            [{**close(a, ha, None), "attrs": {"size": 1}}],  # type: ignore[list-item]
            env.session,
        )
    assert info.value.code == errno.EINVAL


async def test_handle_0_is_a_flush_report_that_keeps_the_handle(env: Env) -> None:
    """A flush's length report goes in `close_files` as handle 0 (with the
    releases that overlap it): the length lands, no handle is given back,
    and the file, unlinked meanwhile, lives until its real close."""
    a, ha = await env.create(ROOT, b"a")
    handles = env.store.read_only.count()
    closed = await env.meta.close_files([close(a, 0, 700, 6_000_000_000)], env.session)
    assert closed[0]["error"] is None and closed[0]["attr"] is not None
    assert (closed[0]["attr"]["size"], closed[0]["attr"]["mtime"]) == (700, 6_000_000_000)
    assert env.store.read_only.count() == handles  # still open
    await env.meta.unlink(ROOT, b"a")
    assert (await env.meta.getattr(a))["nlink"] == 0  # held by its handle
    assert await env.meta.close_files([close(a, ha, None)], env.session) == [
        {"attr": None, "error": None}
    ]
    with pytest.raises(FsError) as info:
        await env.meta.getattr(a)
    assert info.value.code == errno.ENOENT
