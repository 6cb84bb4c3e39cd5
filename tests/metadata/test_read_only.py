"""Read-only work writes nothing: no LMDB write transaction for lookups,
attributes (one inode's or many's), listings, xattr reads, statfs or a read-only open and its
release; yet a file unlinked while open read-only keeps its data until the
last close, across a metadata server restart too (docs/metadata.md,
"Read-only handles")."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from metaservice import CHAINS, Env, ShiftedClock, open_store, service_env

from shufflefs.metadata.protocol import ROOT_INODE, is_read_only_handle
from shufflefs.metadata.readonly import FreeInProgress
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.txn import Tx
from shufflefs.rpc import FsError

if TYPE_CHECKING:
    from conftest import Fs

ROOT = ROOT_INODE


def writes(store: NamespaceStore) -> tuple[int, int]:
    """(write transactions begun, committed) so far."""
    return store.txns.write_count, store.txns.commit_count


async def test_read_only_work_takes_no_write_transaction(env: Env) -> None:
    meta = env.meta
    d = await meta.mkdir(ROOT, b"d", 0o755, 0, 0)
    ino, handle = await env.create(d["ino"], b"f")
    await meta.update_length(ino, 4096)
    await meta.release(ino, handle, env.session)
    link = await meta.symlink(d["ino"], b"l", b"f", 0, 0)
    await meta.setxattr(ino, b"user.k", b"v")
    before = writes(env.store)
    assert before[0] > 0 and before[1] > 0  # the counters do count

    assert (await meta.lookup(d["ino"], b"f"))["ino"] == ino
    assert (await meta.getattr(ino))["size"] == 4096
    many = await meta.getattrs([ino, 1 << 40, d["ino"]])  # (None: no such inode)
    assert [a and a["ino"] for a in many] == [ino, None, d["ino"]]
    with pytest.raises(FsError) as info:
        await meta.getattrs([ino] * 1025)
    assert info.value.code == errno.E2BIG
    assert (await meta.resolve(b"/d/l"))["ino"] == ino
    assert [n for n, _ in (await meta.readdir(d["ino"]))["entries"]] == [b"f", b"l"]
    assert await meta.readlink(link["ino"]) == b"f"
    assert await meta.getxattr(ino, b"user.k") == b"v"
    assert await meta.listxattr(ino) == [b"user.k"]
    assert (await meta.statfs())["files"] == 4
    for target, flags in ((ino, os.O_RDONLY), (d["ino"], os.O_RDONLY | os.O_DIRECTORY)):
        opened = await meta.open(target, flags, env.session)
        assert is_read_only_handle(opened["handle"])
        assert opened["attr"]["ino"] == target
        await meta.release(target, opened["handle"], env.session)
    many_opens = [[ino, os.O_RDONLY], [1 << 40, os.O_RDONLY], [ino, os.O_RDONLY]]
    both = await meta.open_read_only(many_opens, env.session)  # (None: no such inode)
    assert both[1] is None and both[0] and both[2]
    assert both[0]["handle"] != both[2]["handle"]  # a handle each
    await meta.release_read_only([[ino, r["handle"]] for r in both if r], env.session)
    with pytest.raises(FsError) as info:
        await meta.open_read_only([[ino, os.O_RDONLY], [ino, os.O_RDWR]], env.session)
    assert info.value.code == errno.EINVAL and env.store.read_only.held() == set()
    # a lookup with the open that follows it: a handle for a regular file only
    found = await meta.lookup_open(d["ino"], b"f", env.session)
    assert found["attr"]["ino"] == ino and found["layout"] is not None
    assert is_read_only_handle(found["handle"]) and env.store.read_only.held() == {ino}
    await meta.release(ino, found["handle"], env.session)
    other = await meta.lookup_open(d["ino"], b"l", env.session)  # a symlink
    assert other["handle"] == 0 and other["layout"] is None
    here = await meta.lookup_open(ROOT, b"d", env.session)
    assert here["attr"]["ino"] == d["ino"] and here["handle"] == 0
    with pytest.raises(FsError) as info:
        await meta.lookup_open(d["ino"], b"missing", env.session)
    assert info.value.code == errno.ENOENT
    assert env.store.read_only.held() == set()
    assert await env.service.reaper.reap_once() == []
    assert writes(env.store) == before
    assert env.store.counts()["handles"] == 0  # nothing durable either

    # a writing open takes one write transaction (its session check, a cut
    # owed to storage), its handle is held in memory too: its release commits nothing
    opened = await meta.open(ino, os.O_RDWR, env.session)
    assert is_read_only_handle(opened["handle"])
    assert env.store.counts()["handles"] == 0
    assert env.store.read_only.held() == {ino}
    await meta.release(ino, opened["handle"], env.session)
    assert writes(env.store)[1] == before[1] + 1
    assert env.store.read_only.held() == set()


async def test_unlink_while_open_read_only(env: Env) -> None:
    meta = env.meta
    ino, handle = await env.create(ROOT, b"f")
    await meta.update_length(ino, 5 << 20)
    await meta.release(ino, handle, env.session)
    reader = (await meta.session_open("reader", "elsewhere", 2))["session"]
    opened = await meta.open(ino, os.O_RDONLY, reader)
    layout = opened["layout"]
    assert layout is not None

    await meta.unlink(ROOT, b"f")  # another client takes the last name
    with pytest.raises(FsError) as info:
        await meta.lookup(ROOT, b"f")
    assert info.value.code == errno.ENOENT
    attr = await meta.getattr(ino)  # still there for the reader
    assert attr["nlink"] == 0 and attr["size"] == 5 << 20
    again = await meta.open(ino, os.O_RDONLY, reader)  # (a re-open by inode too)
    assert env.store.fsck() == []
    await env.service.jobs.run_once()
    assert env.store.gc_jobs() == [] and env.storage.calls == []  # the data stays

    with pytest.raises(FsError) as info:  # not the other session's to close
        await meta.release(ino, opened["handle"], env.session)
    assert info.value.code == errno.EBADF
    with pytest.raises(FsError) as info:  # nor in a batch, whose other handles go back
        await meta.release_read_only([[ino, opened["handle"]], [ino, again["handle"]]], env.session)
    assert info.value.code == errno.EBADF
    await meta.release(ino, again["handle"], reader)
    assert env.store.gc_jobs() == []  # one reader left
    # the last close frees it (here in a batch, as an open cache gives handles back)
    await meta.release_read_only([[ino, opened["handle"]]], reader)
    assert [j["ino"] for j in env.store.gc_jobs()] == [ino]
    await env.service.jobs.run_once()
    assert env.storage.targets_called("remove", ino) == {CHAINS[c][0] for c in layout["chains"]}
    assert env.store.gc_jobs() == []
    await meta.release(ino, opened["handle"], reader)  # already closed: not an error
    with pytest.raises(FsError) as info:
        await meta.getattr(ino)
    assert info.value.code == errno.ENOENT


async def test_session_close_drops_read_only_handles(env: Env) -> None:
    ino = (await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
    reader = (await env.meta.session_open("reader", "elsewhere", 2))["session"]
    await env.meta.open(ino, os.O_RDONLY, reader)
    await env.meta.unlink(ROOT, b"f")
    assert env.store.gc_jobs() == []
    for _ in range(2):  # the reader's lease runs out; ours is renewed
        env.clock.offset += 40
        await env.meta.session_renew(env.session)
    assert [s["session"] for s in await env.service.reaper.reap_once()] == [reader]
    assert [j["ino"] for j in env.store.gc_jobs()] == [ino]
    assert env.store.read_only.count() == 0
    await env.service.jobs.run_once()
    with pytest.raises(FsError) as info:
        await env.meta.open(ino, os.O_RDONLY, reader)
    assert info.value.code == errno.EKEYEXPIRED


async def test_restart_waits_for_every_session_to_report(tmp_path: Path) -> None:
    """After a restart the in-memory handles are gone: nothing is freed until
    every session then live has renewed (reporting what it holds) or expired."""
    clock = ShiftedClock()
    path = tmp_path / "ns"
    store = open_store(path, clock)
    async with service_env(store, clock) as env:
        ino = (await env.meta.mknod(ROOT, b"held", 0o644, 0, 0, 0))["ino"]
        gone = (await env.meta.mknod(ROOT, b"gone", 0o644, 0, 0, 0))["ino"]
        reader = (await env.meta.session_open("reader", "elsewhere", 2))["session"]
        idle = (await env.meta.session_open("idle", "elsewhere", 3))["session"]
        handle = (await env.meta.open(ino, os.O_RDONLY, reader))["handle"]
        await env.meta.open(gone, os.O_RDONLY, reader)  # closed by the restart, not reported
        await env.meta.session_close(env.session)
    store.close()  # the server stops: its memory (the read-only handles) is lost

    store = open_store(path, clock)
    try:
        assert store.restart_leases() == 2  # reader, idle
        async with service_env(store, clock) as env:
            await env.meta.unlink(ROOT, b"held")
            await env.meta.unlink(ROOT, b"gone")
            await env.meta.session_renew(idle)
            await env.service.reaper.reap_once()
            assert store.gc_jobs() == []  # the reader has not reported yet
            assert (await env.meta.getattr(ino))["nlink"] == 0
            await env.meta.session_renew(reader, [[ino, handle]])
            assert [j["ino"] for j in store.gc_jobs()] == [gone]  # nothing holds it
            assert (await env.meta.getattr(ino))["nlink"] == 0  # the reader still does
            await env.meta.session_renew(reader, [])  # a later report changes nothing
            await env.meta.release(ino, handle, reader)
            assert sorted(j["ino"] for j in store.gc_jobs()) == sorted([gone, ino])
            for job in store.gc_jobs():
                store.gc_done(job["ino"])
    finally:
        store.close()


async def test_restart_grace_ends_when_silent_sessions_expire(tmp_path: Path) -> None:
    clock = ShiftedClock()
    path = tmp_path / "ns"
    store = open_store(path, clock)
    async with service_env(store, clock) as env:
        ino = (await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
        await env.meta.open(ino, os.O_RDONLY, env.session)
    store.close()

    store = open_store(path, clock)
    try:
        store.restart_leases()
        async with service_env(store, clock) as env:
            await env.meta.unlink(ROOT, b"f")
            assert await env.service.reaper.reap_once() == []
            assert store.gc_jobs() == []  # that client may still read it
            for _ in range(2):  # it never came back
                clock.offset += 40
                await env.meta.session_renew(env.session)
            assert len(await env.service.reaper.reap_once()) == 1
            assert [j["ino"] for j in store.gc_jobs()] == [ino]
            store.gc_done(ino)
    finally:
        store.close()


def test_read_only_open_meets_a_free_being_committed(ns: NamespaceStore, fs: Fs) -> None:
    """A free not yet committed marks its inode: a read-only open then must
    wait (the server retries after the writer's transaction), never take a
    handle on an inode whose GC job is about to commit."""
    ino = fs.file(ROOT, b"f")
    seen: list[bool] = []

    def unlink_then_open() -> None:
        assert ns.unlink(ROOT, b"f")  # freed inside the group, not committed yet
        with pytest.raises(FreeInProgress):
            ns.open_read_only(ino, os.O_RDONLY, fs.session)
        seen.append(True)

    assert ns.txns.group([unlink_then_open]) == [(True, None)]
    assert seen == [True]
    with pytest.raises(FsError) as info:  # after the commit: gone
        ns.open(ino, os.O_RDONLY, fs.session)
    assert info.value.code == errno.ENOENT
    assert [j["ino"] for j in ns.gc_jobs()] == [ino]
    ns.gc_done(ino)


async def test_create_and_writing_opens_hold_their_handles_in_memory(tmp_path: Path) -> None:
    """A create costs one commit (the new inode) and its release none; the
    handle keeps an unlinked file alive, across a metadata restart too
    (its client re-reports it with the renewal, as a reader does)."""
    clock = ShiftedClock()
    path = tmp_path / "ns"
    store = open_store(path, clock)
    async with service_env(store, clock) as env:
        writer = (await env.meta.session_open("writer", "elsewhere", 2))["session"]
        before = writes(store)
        made = await env.meta.create(ROOT, b"f", 0o644, os.O_CREAT | os.O_RDWR, 0, 0, writer)
        ino, handle = made["attr"]["ino"], made["handle"]
        assert made.get("created") is True and is_read_only_handle(handle)
        assert writes(store)[1] == before[1] + 1 and store.counts()["handles"] == 0
        again = await env.meta.create(ROOT, b"f", 0o644, os.O_CREAT | os.O_RDWR, 0, 0, writer)
        assert "created" not in again  # an existing file, opened
        await env.meta.release(ino, again["handle"], writer)
        assert writes(store)[1] == before[1] + 2  # the second open; no release commits
        await env.meta.session_close(env.session)
    store.close()  # the server stops: the handle table is lost

    store = open_store(path, clock)
    try:
        store.restart_leases()
        async with service_env(store, clock) as env:
            await env.meta.unlink(ROOT, b"f")
            assert store.gc_jobs() == [] and store.fsck() == []
            await env.meta.session_renew(writer, [[ino, handle]])  # the writer reports it
            assert (await env.meta.getattr(ino))["nlink"] == 0  # held: still there
            await env.meta.update_length(ino, 4096)  # and written through
            await env.meta.release(ino, handle, writer)  # the last close frees it
            assert [j["ino"] for j in store.gc_jobs()] == [ino]
            store.gc_done(ino)
            assert store.fsck() == []
    finally:
        store.close()


def test_a_hold_in_an_aborted_transaction_is_dropped(ns: NamespaceStore, fs: Fs) -> None:
    ino = fs.file(ROOT, b"f")

    def body(tx: Tx) -> None:
        tx.read_only.hold(tx, fs.session, ino)
        assert ns.read_only.held() == {ino}
        raise FsError(errno.EIO, "the transaction fails after the hold")

    with pytest.raises(FsError):
        ns.txns.write(body)
    assert ns.read_only.held() == set() and ns.read_only.count() == 0


async def test_a_session_opened_before_the_restart_grace_begins_is_not_waited_for(
    tmp_path: Path,
) -> None:
    """A client may open its session on a new primary before the primary's
    duties start the restart grace: that session took every handle it holds
    here, so its unlinked files are freed at its last close, not after its
    next renewal (the grace lists only the sessions live at the promotion)."""
    clock = ShiftedClock()
    path = tmp_path / "ns"
    store = open_store(path, clock)
    async with service_env(store, clock) as env:
        old = (await env.meta.session_open("old", "elsewhere", 2))["session"]
        await env.meta.session_close(env.session)
    store.close()

    store = open_store(path, clock)
    try:
        store.txns.read_only.promoted()
        async with service_env(store, clock) as env:
            new = (await env.meta.session_open("new", "here", 3))["session"]
            assert store.restart_leases() >= 2  # the duties ran after the new session's open
            assert store.read_only.started_with >= {old}
            assert new not in store.read_only.started_with
            ino = (await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
            handle = (await env.meta.open(ino, os.O_RDONLY, new))["handle"]
            await env.meta.unlink(ROOT, b"f")
            await env.meta.release(ino, handle, new)
            assert store.gc_jobs() == []  # the old session may hold it
            await env.meta.session_renew(old, [])
            await env.service.reaper.reap_once()
            assert [j["ino"] for j in store.gc_jobs()] == [ino]
            store.gc_done(ino)
    finally:
        store.close()


async def test_inline_opens_leave_what_must_wait_to_the_handler(env: Env) -> None:
    """`open` and `lookup_open` are tried inline (`open_now`,
    `lookup_open_now`): a read-only open is answered there; one that
    writes, or one of an inode whose free is being committed, is left to
    the handler (None), which waits; an error is the handler's error."""
    ino, handle = await env.create(ROOT, b"g")
    await env.meta.release(ino, handle, env.session)
    service, freeing = env.service, env.store.txns.read_only._freeing
    freeing.add(ino)
    try:
        assert service.open_now(ino, os.O_RDONLY, env.session) is None
        assert service.lookup_open_now(ROOT, b"g", env.session) is None
    finally:
        freeing.discard(ino)
    assert service.open_now(ino, os.O_RDWR, env.session) is None
    for opened in (
        service.open_now(ino, os.O_RDONLY, env.session),
        service.lookup_open_now(ROOT, b"g", env.session),
    ):
        assert opened is not None and opened["attr"]["ino"] == ino and opened["layout"]
        await env.meta.release(ino, opened["handle"], env.session)
    with pytest.raises(FsError) as raised:
        service.lookup_open_now(ROOT, b"missing", env.session)
    assert raised.value.code == errno.ENOENT
    # and over the wire, through the inline try
    opened = await env.meta.lookup_open(ROOT, b"g", env.session)
    await env.meta.release(ino, opened["handle"], env.session)
