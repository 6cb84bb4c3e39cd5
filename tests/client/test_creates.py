"""A client's overlapping creates go in one `create_files` call
(client/creates.py): the first alone at once, the ones that arrive while it
is in flight together in the next; each caller gets its own file, or its
own error; a server of before `create_files` (ENOSYS) gets a `create` each.
The metadata server is the real one (tests/metaservice.py); the session
stand-in hands it our session id."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from metaservice import Env
from metaservice import env as env  # the fixture

from shufflefs.client.creates import Creates
from shufflefs.metadata.protocol import ROOT_INODE, OpenResult
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError

NEW = os.O_CREAT | os.O_EXCL | os.O_WRONLY


class SessionOf:
    """`Session.call`'s part: each call with our session; *refuse* makes a
    method ENOSYS (a server of before it)."""

    def __init__(self, env: Env, refuse: str = "") -> None:
        self.env, self.refuse = env, refuse
        self.calls: list[str] = []

    async def call(self, what: str, fn: Callable[[MetaStub, int], Awaitable[Any]]) -> Any:
        self.calls.append(what)
        if what == self.refuse:
            raise FsError(errno.ENOSYS, f"no method {what!r}")
        return await fn(self.env.meta, self.env.session)


async def _create_all(creates: Creates, names: list[bytes]) -> dict[bytes, OpenResult | int]:
    out: dict[bytes, OpenResult | int] = {}

    async def one(name: bytes) -> None:
        try:
            out[name] = await creates.create(ROOT_INODE, name, 0o644, NEW, 0, 0)
        except FsError as exc:
            out[name] = exc.code

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(one, name)
    return out


async def test_overlapping_creates_share_one_call_each_answered_on_its_own(env: Env) -> None:
    await env.create(ROOT_INODE, b"taken")
    session = SessionOf(env)
    creates = Creates(session)  # type: ignore[arg-type]
    names = [b"f%02d" % i for i in range(20)] + [b"taken"]
    out = await _create_all(creates, names)
    assert session.calls == ["create", "create_files"]  # the first alone, the rest together
    assert (creates.batch.calls, creates.batch.asked) == (1, 20)
    assert out[b"taken"] == errno.EEXIST
    inos = set()
    for name in names[:-1]:
        opened = out[name]
        assert not isinstance(opened, int) and opened.get("created")
        assert (await env.meta.lookup(ROOT_INODE, name))["ino"] == opened["attr"]["ino"]
        inos.add(opened["attr"]["ino"])
        await env.meta.release(opened["attr"]["ino"], opened["handle"], env.session)
    assert len(inos) == 20


@pytest.mark.parametrize("names", [[b"a"], [b"a", b"b", b"c"]])
async def test_a_server_without_create_files_gets_a_create_each(
    env: Env, names: list[bytes]
) -> None:
    session = SessionOf(env, refuse="create_files")
    creates = Creates(session)  # type: ignore[arg-type]
    out = await _create_all(creates, names)
    assert all(not isinstance(v, int) for v in out.values())
    assert session.calls.count("create") == len(names)
    out = await _create_all(creates, [b"d", b"e"])  # no batch tried again
    assert session.calls.count("create_files") <= 1
    for opened in out.values():
        assert not isinstance(opened, int)


async def test_a_cancelled_leader_leaves_its_batch_answered(env: Env) -> None:
    """The caller that sends a batch is cancelled after the server made the
    files: the others still get their own files, not EEXIST from asking
    again alone (the call is shielded from its leader's cancellation)."""
    session = SessionOf(env)
    creates = Creates(session)  # type: ignore[arg-type]
    first_reply, made, reply = trio.Event(), trio.Event(), trio.Event()
    calls = session.call

    async def call_held(what: str, fn: Callable[[MetaStub, int], Awaitable[Any]]) -> Any:
        result = await calls(what, fn)
        if what == "create":
            await first_reply.wait()  # in flight until the batch behind it is gathered
        else:
            made.set()
            await reply.wait()  # held back until the leader is cancelled
        return result

    session.call = call_held  # type: ignore[method-assign]
    out: dict[bytes, OpenResult | int] = {}

    async def one(name: bytes, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            try:
                out[name] = await creates.create(ROOT_INODE, name, 0o644, NEW, 0, 0)
            except FsError as exc:
                out[name] = exc.code

    leader = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, b"alone")  # in flight: the next ones batch behind it
        await trio.testing.wait_all_tasks_blocked()
        assert session.calls == ["create"]
        nursery.start_soon(one, b"lead", leader)
        nursery.start_soon(one, b"other")
        await trio.testing.wait_all_tasks_blocked()
        first_reply.set()
        await made.wait()
        leader.cancel()
        await trio.testing.wait_all_tasks_blocked()
        reply.set()
    assert session.calls == ["create", "create_files"]
    other = out[b"other"]
    assert not isinstance(other, int) and other.get("created")
    assert (await env.meta.lookup(ROOT_INODE, b"lead"))["ino"] != other["attr"]["ino"]


async def test_creates_not_asked_together_each_go_at_once(env: Env) -> None:
    """A mount's creates (`together=False`, `FileSystem.create`'s default):
    a call each, none waiting for another's."""
    session = SessionOf(env)
    creates = Creates(session)  # type: ignore[arg-type]
    out: dict[bytes, OpenResult] = {}

    async def one(name: bytes) -> None:
        out[name] = await creates.create(ROOT_INODE, name, 0o644, NEW, 0, 0, together=False)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(one, b"m%d" % i)
    assert session.calls == ["create"] * 5 and creates.batch.calls == 0
    assert len({o["attr"]["ino"] for o in out.values()}) == 5
