"""Log shipping between metadata servers, in-process: the log entries a
group commit makes, applying them in order on a follower, epoch fencing,
and the majority wait of the primary."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from metaservice import Env

from shufflefs.metadata import request_ids
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.records import ALL_DBS, DB_INFO, DB_REQUESTS, pack
from shufflefs.metadata.replication import (
    NOT_ACKNOWLEDGED,
    ReplicationService,
    Replicator,
)
from shufflefs.metadata.replication_snapshot import SnapshotReceiver, send_snapshot
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.stub import MetaStub
from shufflefs.metadata.writer import Writer
from shufflefs.rpc import FsError, RpcServer, open_rpc_client
from tests.metaservice import SECRET


def open_ns(path: Path) -> NamespaceStore:
    return NamespaceStore(path, map_size=64 << 20, sync=False)


def contents(ns: NamespaceStore) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """Every replicated record."""

    def body(tx: Any) -> dict[bytes, list[tuple[bytes, bytes]]]:
        return {db: list(tx.prefix_items(db, b"")) for db in ALL_DBS if db != DB_INFO}

    return ns.txns.read(body)


def all_entries(ns: NamespaceStore) -> list[list[Any]]:
    with ns.env.begin() as txn:
        return ns.txns.log.entries(txn, 1, 1 << 30)


async def mutate(ns: NamespaceStore, count: int, prefix: bytes = b"f") -> None:
    """*count* creates, renames and unlinks through group commit."""
    write = Writer(ns.txns)
    session = (await write(ns.session_open, "t", "h", os.getpid()))["session"]
    layout = {"chunk_size": 1 << 20, "chains": [1]}
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(
                lambda i=i: write(
                    ns.create,
                    ROOT_INODE,
                    prefix + b"%d" % i,
                    0o644,
                    os.O_CREAT | os.O_RDWR,
                    0,
                    0,
                    session,
                    lambda: layout,
                )
            )
    await write(ns.rename, ROOT_INODE, prefix + b"0", ROOT_INODE, prefix + b"r", 0)
    await write(ns.unlink, ROOT_INODE, prefix + b"1")


async def test_log_entries_replay_to_the_same_namespace(tmp_path: Path) -> None:
    primary, follower = open_ns(tmp_path / "a"), open_ns(tmp_path / "b")
    try:
        await mutate(primary, 50)
        entries = all_entries(primary)
        seqs = [e[0] for e in entries]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) < 53  # groups shared entries
        assert primary.txns.position().applied_seq == seqs[-1]
        for entry in entries:  # one at a time, as a slow follower would
            follower.txns.apply_entries([entry], 0)
        assert contents(follower) == contents(primary)
        assert follower.fsck() == [] and follower.txns.position().applied_seq == seqs[-1]
        assert all_entries(follower) == entries  # it can serve them on, once promoted
    finally:
        primary.close()
        follower.close()


async def test_out_of_order_entry_is_refused_and_nothing_applied(tmp_path: Path) -> None:
    primary, follower = open_ns(tmp_path / "a"), open_ns(tmp_path / "b")
    try:
        await mutate(primary, 3)
        entries = all_entries(primary)
        before = contents(follower)
        with pytest.raises(FsError) as info:
            follower.txns.apply_entries([entries[0], entries[2]], 0)  # a gap
        assert info.value.code == errno.EINVAL
        assert contents(follower) == before and follower.txns.position().applied_seq == 0
        with pytest.raises(FsError):
            follower.txns.apply_entries([[1, 0, [[b"info", b"format", b"x"]]]], 0)
        assert follower.txns.position().applied_seq == 0  # info is each server's own
    finally:
        primary.close()
        follower.close()


def test_trim_keeps_the_epoch_of_the_last_trimmed_entry(tmp_path: Path) -> None:
    ns = open_ns(tmp_path / "a")
    try:
        ns.txns.epoch = 4
        for i in range(5):
            ns.txns.write(lambda tx, i=i: tx.put(b"counters", b"k%d" % i, b"v"))
        assert ns.txns.trim_log(3) == 3
        with ns.env.begin() as txn:
            assert [e[0] for e in ns.txns.log.entries(txn, 4, 1 << 20)] == [4, 5]
            assert ns.txns.log.entries(txn, 1, 1 << 20) == []
            assert ns.txns.log.epoch_at(txn, 3) == 4 and ns.txns.log.epoch_at(txn, 2) is None
    finally:
        ns.close()


class Followers:
    """Follower stores behind real rpc servers on loopback."""

    def __init__(self) -> None:
        self.stores: list[NamespaceStore] = []
        self.addresses: dict[int, str] = {}
        self.scopes: dict[int, trio.CancelScope] = {}
        self.seen: list[int] = []

    async def start(self, nursery: trio.Nursery, node: int, ns: NamespaceStore) -> None:
        service = ReplicationService(
            ns.txns, epoch_seen=self.seen.append, may_follow=lambda e: True
        )
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await RpcServer(SECRET, [service], name="f").serve(
                    "127.0.0.1", 0, task_status=task_status
                )

        port = await nursery.start(run)
        self.addresses[node] = f"127.0.0.1:{port}"
        self.scopes[node] = scope


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[tuple[NamespaceStore, list[NamespaceStore], Any]]:
    stores = [open_ns(tmp_path / f"m{i}") for i in range(3)]
    try:
        async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
            followers = Followers()
            for i in (1, 2):
                await followers.start(nursery, i, stores[i])
            yield stores[0], stores[1:], (rpc, followers, nursery)
            nursery.cancel_scope.cancel()
    finally:
        for ns in stores:
            ns.close()


async def test_majority_acknowledges_and_followers_converge(group: Any) -> None:
    primary, followers, (rpc, links, nursery) = group
    deposed: list[int] = []
    primary.txns.epoch = 1
    rep = Replicator(
        primary.txns,
        rpc,
        peers=lambda: links.addresses,
        group_size=lambda: 3,
        epoch=1,
        deposed=deposed.append,
    )
    nursery.start_soon(rep.run)
    write = Writer(primary.txns, durable=lambda seq: _durable(rep, seq))
    await write(primary.mkdir, ROOT_INODE, b"d", 0o755, 0, 0)
    assert rep.holders(primary.txns.last_seq) >= 2
    links.scopes[2].cancel()  # one follower gone: a majority is still there
    for i in range(20):
        await write(primary.mkdir, ROOT_INODE, b"e%d" % i, 0o755, 0, 0)
    with trio.fail_after(10):
        while followers[0].txns.position().applied_seq < primary.txns.last_seq:
            await trio.sleep(0.01)
    assert contents(followers[0]) == contents(primary) and followers[0].fsck() == []
    assert links.seen and min(links.seen) == 1 and not deposed
    links.scopes[1].cancel()  # both gone: nothing is acknowledged
    with pytest.raises(FsError) as info:
        await write(primary.mkdir, ROOT_INODE, b"lost", 0o755, 0, 0)
    assert info.value.code == NOT_ACKNOWLEDGED


async def _durable(rep: Replicator, seq: int) -> None:
    rep.committed()
    await rep.wait_durable(seq, timeout=1.5)


async def test_the_log_is_trimmed_to_what_every_member_has(tmp_path: Path) -> None:
    """A follower in touch holds the log back to its position; one out of
    touch, or a member of the group not registered yet, to *keep* entries."""
    with open_ns(tmp_path / "p") as ns:
        await mutate(ns, 30)
        last = ns.txns.last_seq
        peers = {1: "a:1"}
        rep = Replicator(
            ns.txns, None, peers=lambda: peers, group_size=lambda: 2, epoch=1, deposed=print
        )  # type: ignore[arg-type]
        rep.acked[1] = last - 2
        assert rep.trim_point(keep=5) == last - 2  # the whole group in touch
        rep.acked.clear()
        assert rep.trim_point(keep=5) == last - 5  # out of touch
        rep.acked[1] = last - 2
        rep.group_size = lambda: 3  # a third member, not registered yet
        assert rep.trim_point(keep=5) == last - 5


async def test_follower_refuses_an_older_epoch_and_deposes_its_sender(group: Any) -> None:
    primary, followers, (rpc, links, nursery) = group
    addr = links.addresses[1]
    reply = await rpc.call(addr, "repl_append", {"epoch": 5, "prev_seq": -1, "prev_epoch": 0})
    assert reply["epoch"] == 5 and followers[0].txns.position().epoch == 5
    with pytest.raises(FsError) as info:
        await rpc.call(addr, "repl_append", {"epoch": 4, "prev_seq": -1, "prev_epoch": 0})
    assert info.value.code == errno.ESTALE
    # entries that do not follow its log are not applied; it answers where it is
    entry = [[2, 5, [[b"counters", b"x", b"y"]]]]
    args = {"epoch": 5, "prev_seq": 1, "prev_epoch": 5}
    reply = await rpc.call(addr, "repl_append", args, payload=pack(entry))
    assert reply["applied_seq"] == 0
    # a primary of epoch 4 learns that it is deposed when it ships
    deposed: list[int] = []
    primary.txns.epoch = 4
    rep = Replicator(
        primary.txns,
        rpc,
        peers=lambda: {1: addr},
        group_size=lambda: 3,
        epoch=4,
        deposed=deposed.append,
    )
    nursery.start_soon(rep.run)
    with trio.fail_after(5):
        while not deposed:
            await trio.sleep(0.01)
    assert deposed == [4]


async def test_a_retried_mutation_is_answered_not_applied_again(env: Env) -> None:
    once = MetaStub(env.meta.rpc, env.meta.address, request=[7, 1])
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    first = await once.create(ROOT_INODE, b"x", 0o644, flags, 0, 0, env.session)
    again = await once.create(ROOT_INODE, b"x", 0o644, flags, 0, 0, env.session)
    assert again == first  # not EEXIST: the same file, the same handle
    with pytest.raises(FsError) as info:  # another request id is another create
        await MetaStub(env.meta.rpc, env.meta.address, request=[7, 2]).create(
            ROOT_INODE, b"x", 0o644, flags, 0, 0, env.session
        )
    assert info.value.code == errno.EEXIST
    move = MetaStub(env.meta.rpc, env.meta.address, request=[7, 3])
    await move.rename(ROOT_INODE, b"x", ROOT_INODE, b"y")
    await move.rename(ROOT_INODE, b"x", ROOT_INODE, b"y")  # not ENOENT
    gone = MetaStub(env.meta.rpc, env.meta.address, request=[7, 4])
    await gone.unlink(ROOT_INODE, b"y")
    await gone.unlink(ROOT_INODE, b"y")
    await env.meta.release(first["attr"]["ino"], first["handle"], env.session)
    with pytest.raises(FsError) as info:
        await env.meta.lookup(ROOT_INODE, b"y")
    assert info.value.code == errno.ENOENT
    # a failed mutation stores nothing: its retry runs again
    failing = MetaStub(env.meta.rpc, env.meta.address, request=[7, 5])
    for _ in range(2):
        with pytest.raises(FsError):
            await failing.unlink(ROOT_INODE, b"nothing")
    # results are kept KEEP seconds, then trimmed
    assert env.store.txns.read(lambda tx: tx.entries(DB_REQUESTS)) == 3
    assert request_ids.trim(env.store.txns, time.time() + request_ids.KEEP + 1) == 3
    with pytest.raises(FsError) as info:
        await MetaStub(env.meta.rpc, env.meta.address, request=[-1, 0]).unlink(ROOT_INODE, b"z")
    assert info.value.code == errno.EINVAL


async def test_a_snapshot_brings_a_diverged_follower_to_the_primary(tmp_path: Path) -> None:
    primary, follower = open_ns(tmp_path / "a"), open_ns(tmp_path / "b")
    try:
        primary.txns.epoch, follower.txns.epoch = 2, 1
        await mutate(primary, 20)
        await mutate(follower, 5, prefix=b"never-acknowledged")  # a deposed primary's own
        receiver = SnapshotReceiver(follower)
        async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
            service = ReplicationService(
                follower.txns,
                epoch_seen=lambda e: None,
                may_follow=lambda e: True,
                snapshots=receiver,
            )
            port = await nursery.start(RpcServer(SECRET, [service], name="f").serve, "127.0.0.1", 0)
            await send_snapshot(primary, rpc, f"127.0.0.1:{port}", 2)
            nursery.cancel_scope.cancel()
        assert contents(follower) == contents(primary) and follower.fsck() == []
        assert follower.txns.position() == primary.txns.position()
        assert not (tmp_path / "namespace.recv").exists()
    finally:
        primary.close()
        follower.close()
