"""The metadata service behind a real RpcServer on loopback, called through
MetaStub over a real RpcClient. Storage daemons and mgmtd are small fakes
serving the same rpc methods, so storage jobs and registration are exercised
over the wire too."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import trio
from clusters import eventually
from metaservice import CHAINS, Env, FakeStorage, routing_info

from shufflefs.cluster.node import advertised_address, listen_address
from shufflefs.cluster.protocol import RoutingInfo, TargetRegistration, TargetUsage
from shufflefs.metadata.config import MetaConfig
from shufflefs.metadata.process import main, serve
from shufflefs.metadata.protocol import RENAME_EXCHANGE, ROOT_INODE, SESSION_EXPIRED, XATTR_CREATE
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError, RpcServer, open_rpc_client, rpc_method
from shufflefs.rpc.cluster_secret import generate_secret, load_secret
from shufflefs.rpc.config import load_config

ROOT = ROOT_INODE


async def test_namespace_over_rpc(env: Env) -> None:
    meta = env.meta
    d = await meta.mkdir(ROOT, b"data", 0o755, 1000, 1000)
    assert stat.S_ISDIR(d["mode"]) and d["parent"] == ROOT
    assert await meta.lookup(ROOT, b"data") == d
    ino, handle = await env.create(d["ino"], b"shard-0000")
    attr = await meta.update_length(ino, 5 << 20, mtime=123)
    assert attr["size"] == 5 << 20 and attr["mtime"] == 123
    assert (await meta.getattr(ino))["size"] == 5 << 20
    assert (await meta.resolve(b"/data/shard-0000"))["ino"] == ino
    link = await meta.symlink(ROOT, b"latest", b"data/shard-0000", 0, 0)
    assert await meta.readlink(link["ino"]) == b"data/shard-0000"
    assert (await meta.resolve(b"/latest"))["ino"] == ino
    assert (await meta.resolve(b"/latest", follow=False))["ino"] == link["ino"]
    assert (await meta.link(ino, ROOT, b"hard"))["nlink"] == 2
    await meta.rename(ROOT, b"hard", d["ino"], b"hard2")
    page = await meta.readdir(d["ino"])
    assert [name for name, _ in page["entries"]] == [b"hard2", b"shard-0000"]
    assert page["entries"][0][1]["ino"] == ino and not page["more"]
    first = await meta.readdir(ROOT, None, 1)
    assert first["more"] and len(first["entries"]) == 1
    rest = await meta.readdir(ROOT, first["entries"][0][0], 10)
    assert [n for n, _ in first["entries"] + rest["entries"]] == [b"data", b"latest"]
    await meta.setxattr(ino, b"user.label", b"\x00\xff", XATTR_CREATE)
    assert await meta.getxattr(ino, b"user.label") == b"\x00\xff"
    assert await meta.listxattr(ino) == [b"user.label"]
    await meta.removexattr(ino, b"user.label")
    chmod = await meta.setattr(ino, mode=0o600, uid=7)
    assert stat.S_IMODE(chmod["mode"]) == 0o600 and chmod["uid"] == 7
    assert (await meta.statfs())["files"] == 4
    fifo = await meta.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o600, 0, 0, 0)
    opened = await meta.open(fifo["ino"], os.O_RDONLY, env.session)
    assert opened["layout"] is None
    await meta.release(fifo["ino"], opened["handle"], env.session)
    await meta.release(ino, handle, env.session)
    await meta.unlink(d["ino"], b"hard2")
    await meta.unlink(d["ino"], b"shard-0000")
    await meta.rmdir(ROOT, b"data")
    await meta.session_renew(env.session)
    await meta.session_close(env.session)
    with pytest.raises(FsError) as info:
        await meta.session_renew(env.session)
    assert info.value.code == errno.ENOENT


async def test_errors_cross_the_wire(env: Env) -> None:
    meta = env.meta
    await meta.mkdir(ROOT, b"d", 0o755, 0, 0)
    f = (await meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
    cases: list[tuple[int, Any]] = [
        (errno.ENOENT, meta.lookup(ROOT, b"nothing")),
        (errno.ENOENT, meta.getattr(424242)),
        (errno.EEXIST, meta.mkdir(ROOT, b"d", 0o755, 0, 0)),
        (errno.ENOTDIR, meta.mkdir(f, b"x", 0o755, 0, 0)),
        (errno.ENAMETOOLONG, meta.mkdir(ROOT, b"n" * 256, 0o755, 0, 0)),
        (errno.EINVAL, meta.mkdir(ROOT, b"a/b", 0o755, 0, 0)),
        (errno.EISDIR, meta.unlink(ROOT, b"d")),
        (errno.EPERM, meta.link(ROOT, ROOT, b"x")),
        (errno.EINVAL, meta.rename(ROOT, b"d", ROOT, b"d/x")),
        (errno.ENOENT, meta.rename(ROOT, b"f", ROOT, b"g", RENAME_EXCHANGE)),
        (errno.ENODATA, meta.getxattr(f, b"user.nothing")),
        (errno.EOPNOTSUPP, meta.setxattr(f, b"bogus.x", b"")),
        (errno.EFBIG, meta.setattr(f, size=1 << 60)),
        (SESSION_EXPIRED, meta.open(f, os.O_RDONLY, 999_999)),
    ]
    for expected, call in cases:
        with pytest.raises(FsError) as info:
            await call
        assert info.value.code == expected, info.value


@pytest.mark.parametrize(
    "method,args,expected",
    [
        ("lookup", {"parent": ROOT, "name": "str-not-bytes"}, errno.EINVAL),
        ("lookup", {"parent": "1", "name": b"x"}, errno.EINVAL),
        ("lookup", {"parent": True, "name": b"x"}, errno.EINVAL),
        ("lookup", {"parent": ROOT}, errno.EINVAL),
        ("lookup", {"parent": ROOT, "name": b"x", "extra": 1}, errno.EINVAL),
        ("lookup", {"parent": ROOT, "name": b"x" * 300}, errno.ENAMETOOLONG),
        ("getattr", {"ino": -5}, errno.EINVAL),
        ("getattr", {"ino": 0}, errno.EINVAL),
        ("getattr", {"ino": (1 << 64) - 1}, errno.ENOENT),
        ("readdir", {"ino": ROOT, "after": None, "limit": -1}, errno.EINVAL),
        ("readdir", {"ino": ROOT, "after": b"x" * 1000, "limit": 1}, errno.EINVAL),
        ("setattr", {"ino": ROOT, "mode": 1 << 40}, errno.EINVAL),
        ("setattr", {"ino": ROOT, "atime": 1 << 63}, errno.EINVAL),
        ("mkdir", {"parent": ROOT, "name": b"x", "mode": 0o755, "uid": -1, "gid": 0}, errno.EINVAL),
        (
            "symlink",
            {"parent": ROOT, "name": b"l", "target": b"t\0", "uid": 0, "gid": 0},
            errno.EINVAL,
        ),
        ("resolve", {"path": b"relative", "follow": True}, errno.EINVAL),
        ("session_open", {"client": "c" * 1000, "host": "h", "pid": 1}, errno.EINVAL),
        ("release", {"ino": ROOT, "handle": -1, "session": 1}, errno.EINVAL),
        ("no_such_method", {}, errno.ENOSYS),
    ],
)
async def test_malformed_requests(
    env: Env, method: str, args: dict[str, Any], expected: int
) -> None:
    with pytest.raises(FsError) as info:
        await env.meta._call(method, **args)
    assert info.value.code == expected
    assert (await env.meta.getattr(ROOT))["ino"] == ROOT  # still serving


async def test_layouts_spread_over_writable_chains(env: Env) -> None:
    firsts = set()
    for i in range(9):
        result = await env.meta.create(
            ROOT, b"f%d" % i, 0o644, os.O_CREAT | os.O_RDWR, 0, 0, env.session
        )
        layout = result["layout"]
        assert layout is not None and layout["chunk_size"] == 1 << 20
        assert len(layout["chains"]) == 2 and len(set(layout["chains"])) == 2
        assert set(layout["chains"]) <= set(CHAINS)
        firsts.add(layout["chains"][0])
        await env.meta.release(result["attr"]["ino"], result["handle"], env.session)
    assert firsts == set(CHAINS)  # new files start on every chain in turn
    env.routing.set_target_state(104, "offline")  # chain 2 is no longer writable
    for i in range(6):
        made = await env.meta.mknod(ROOT, b"g%d" % i, stat.S_IFREG | 0o644, 0, 0, 0)
        opened = await env.meta.open(made["ino"], os.O_RDONLY, env.session)
        assert opened["layout"] is not None and set(opened["layout"]["chains"]) == {1, 3}
        await env.meta.release(made["ino"], opened["handle"], env.session)


async def test_chains_below_min_replicas_refuse_new_files(env: Env) -> None:
    for chain in CHAINS.values():
        env.routing.set_target_state(chain[0], "offline")
    with pytest.raises(FsError) as info:
        await env.meta.create(ROOT, b"f", 0o644, os.O_CREAT | os.O_RDWR, 0, 0, env.session)
    assert info.value.code == errno.EROFS and "min_replicas" in info.value.message
    with pytest.raises(FsError) as info:
        await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0)
    assert info.value.code == errno.EROFS
    await env.meta.mkdir(ROOT, b"dirs-need-no-storage", 0o755, 0, 0)
    await env.meta.mknod(ROOT, b"nor-fifos", stat.S_IFIFO | 0o644, 0, 0, 0)


async def test_no_serving_chain_at_all_is_erofs(env: Env) -> None:
    for targets in CHAINS.values():
        for t in targets:
            env.routing.set_target_state(t, "offline")
    with pytest.raises(FsError) as info:
        await env.meta.create(ROOT, b"f", 0o644, os.O_CREAT | os.O_RDWR, 0, 0, env.session)
    assert info.value.code == errno.EROFS


async def test_shrink_cuts_chunks_before_the_reply(env: Env) -> None:
    ino, handle = await env.create(ROOT, b"f")
    layout = (await env.meta.open(ino, os.O_RDONLY, env.session))["layout"]
    assert layout is not None
    targets = {CHAINS[c][0] for c in layout["chains"]}  # each chain's head
    await env.meta.update_length(ino, 10 << 20)
    await env.meta.setattr(ino, size=20 << 20)  # growing: nothing to do on storage
    assert env.storage.calls == []
    attr = await env.meta.setattr(ino, size=3000)
    assert attr["size"] == 3000
    assert env.storage.targets_called("truncate", ino) == targets  # already, at the reply
    assert {c[3:] for c in env.storage.calls} == {(3000, 1 << 20)}
    assert env.store.truncate_job(ino) is None
    env.storage.calls.clear()
    opened = await env.meta.open(ino, os.O_WRONLY | os.O_TRUNC, env.session)
    assert opened["attr"]["size"] == 0
    assert env.storage.targets_called("truncate", ino) == targets
    await env.meta.release(ino, opened["handle"], env.session)
    await env.meta.release(ino, handle, env.session)


async def test_shrink_with_storage_down(env: Env) -> None:
    ino, handle = await env.create(ROOT, b"f")
    await env.meta.update_length(ino, 10 << 20)
    for t in (101, 103, 105):  # one target of every chain
        env.storage.broken.add(t)
    with pytest.raises(FsError) as info:
        await env.meta.setattr(ino, size=100)
    assert info.value.code == errno.EIO
    assert (await env.meta.getattr(ino))["size"] == 100  # the new size stands
    assert env.store.truncate_job(ino) is not None
    handles_before = env.store.counts()["handles"]
    with pytest.raises(FsError) as info:  # a writer must wait for the cut
        await env.meta.open(ino, os.O_RDWR, env.session)
    assert info.value.code == errno.EIO
    assert env.store.counts()["handles"] == handles_before  # no handle leaked
    reader = await env.meta.open(ino, os.O_RDONLY, env.session)  # readers are fine
    await env.meta.release(ino, reader["handle"], env.session)
    env.storage.broken.clear()
    await env.service.jobs.run_once()  # the job is retried by the worker's next pass
    assert env.store.truncate_job(ino) is None
    writer = await env.meta.open(ino, os.O_RDWR, env.session)
    await env.meta.release(ino, writer["handle"], env.session)
    await env.meta.release(ino, handle, env.session)


async def test_gc_after_last_name_and_handle(env: Env) -> None:
    ino, handle = await env.create(ROOT, b"f")
    layout = (await env.meta.open(ino, os.O_RDONLY, env.session))["layout"]
    assert layout is not None
    targets = {CHAINS[c][0] for c in layout["chains"]}  # each chain's head
    await env.meta.unlink(ROOT, b"f")
    assert (await env.meta.getattr(ino))["nlink"] == 0
    await env.service.jobs.run_once()
    assert env.storage.calls == []  # still open: the data must stay
    await env.meta.session_close(env.session)  # closes both handles
    await env.service.jobs.run_once()
    assert env.store.gc_jobs() == []
    assert env.storage.targets_called("remove", ino) == targets
    await env.meta.release(ino, handle, env.session)  # already closed: not an error
    with pytest.raises(FsError) as info:
        await env.meta.getattr(ino)
    assert info.value.code == errno.ENOENT


async def test_gc_waits_for_unreachable_targets(env: Env) -> None:
    ino = (await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
    layout = (await env.meta.open(ino, os.O_RDONLY, env.session))["layout"]
    assert layout is not None
    sick = CHAINS[layout["chains"][0]][0]  # the head of one chain fails
    down = CHAINS[layout["chains"][1]]  # another chain has no serving target at all
    env.storage.broken.add(sick)
    for t in down:
        env.routing.set_target_state(t, "offline")
    await env.meta.session_close(env.session)
    await env.meta.rename(ROOT, b"f", ROOT, b"g")
    await env.meta.unlink(ROOT, b"g")
    await env.service.jobs.run_once()
    assert [j["ino"] for j in env.store.gc_jobs()] == [ino]  # kept while a chain fails
    assert env.storage.targets_called("remove", ino) == set()  # nobody serves: not called
    env.storage.broken.clear()
    await env.service.jobs.run_once()
    assert env.storage.targets_called("remove", ino) == {sick}  # retried: the sick chain is done
    assert [j["ino"] for j in env.store.gc_jobs()] == [ino]  # still waits for the dead chain
    for t in down:
        env.routing.set_target_state(t, "serving")
    await env.service.jobs.run_once()
    assert env.store.gc_jobs() == []
    assert env.storage.targets_called("remove", ino) == {sick, down[0]}


async def test_background_worker_runs_when_woken(env: Env) -> None:
    """What the tests above run by hand, the service's background duties do
    by themselves: a freed file's chunks go with nobody calling run_once."""
    async with trio.open_nursery() as nursery:
        await nursery.start(env.service.run_background)
        ino = (await env.meta.mknod(ROOT, b"f", 0o644, 0, 0, 0))["ino"]
        await env.meta.unlink(ROOT, b"f")  # freed: wakes the worker
        await eventually(lambda: env.store.gc_jobs() == [])
        nursery.cancel_scope.cancel()
    assert env.storage.targets_called("remove", ino)


async def test_expired_session_frees_its_files(env: Env) -> None:
    other = (await env.meta.session_open("doomed", "elsewhere", 1))["session"]
    result = await env.meta.create(ROOT, b"f", 0o644, os.O_CREAT | os.O_RDWR, 0, 0, other)
    ino = result["attr"]["ino"]
    await env.meta.unlink(ROOT, b"f")
    env.clock.offset += 40
    await env.meta.session_renew(env.session)  # ours is renewed, the other one is not
    assert await env.service.reaper.reap_once() == []  # the other lease has 20 s left
    await env.service.jobs.run_once()
    assert env.storage.calls == []
    env.clock.offset += 40
    assert [s["session"] for s in await env.service.reaper.reap_once()] == [other]
    await env.service.jobs.run_once()
    assert env.store.gc_jobs() == [] and bool(env.storage.calls)
    assert env.storage.targets_called("remove", ino)
    await env.meta.session_renew(env.session)
    with pytest.raises(FsError) as info:
        await env.meta.session_renew(other)
    assert info.value.code == errno.ENOENT
    with pytest.raises(FsError) as info:
        await env.meta.open(ROOT, os.O_RDONLY, other)
    assert info.value.code == SESSION_EXPIRED


async def test_concurrent_mutations(env: Env) -> None:
    async def worker(i: int) -> None:
        d = await env.meta.mkdir(ROOT, b"d%02d" % i, 0o755, 0, 0)
        for j in range(5):
            ino, handle = await env.create(d["ino"], b"f%d" % j)
            await env.meta.update_length(ino, j * 1000)
            await env.meta.release(ino, handle, env.session)
        await env.meta.rename(d["ino"], b"f0", ROOT, b"moved%02d" % i)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(worker, i)
    root = await env.meta.readdir(ROOT, None, 100)
    assert len(root["entries"]) == 40
    assert (await env.meta.getattr(ROOT))["nlink"] == 22
    assert env.store.fsck() == []


# ---- the process: serve() against a fake mgmtd ------------------------------------


class FakeMgmtd:
    def __init__(self, info: RoutingInfo) -> None:
        self.info = info
        self.registrations: list[dict[str, Any]] = []
        self.unregistered: list[int] = []
        self.heartbeats = 0

    @rpc_method
    async def register_node(
        self,
        cluster_id: str | None,
        kind: str,
        address: str,
        host: str,
        pid: int,
        node_id: int | None,
        targets: list[TargetRegistration],
    ) -> Any:
        self.registrations.append(
            {"cluster_id": cluster_id, "kind": kind, "address": address, "node_id": node_id}
        )
        return {
            "node_id": node_id or 7,
            "target_ids": [],
            "routing_version": self.info["version"],
            "cluster_id": "test-cluster",
        }

    @rpc_method
    async def heartbeat(self, node_id: int, pid: int, targets: list[TargetUsage]) -> Any:
        self.heartbeats += 1
        return {"routing_version": self.info["version"]}

    @rpc_method
    async def unregister_node(self, node_id: int) -> None:
        self.unregistered.append(node_id)

    @rpc_method
    async def get_routing(self, known_version: int) -> RoutingInfo | None:
        return None if known_version == self.info["version"] else self.info


async def test_serve_registers_recovers_and_unregisters(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret = generate_secret(secret_file)
    storage = FakeStorage()
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        storage_port = await nursery.start(
            RpcServer(secret, [storage], name="storage").serve, "127.0.0.1", 0
        )
        mgmtd = FakeMgmtd(routing_info(f"127.0.0.1:{storage_port}"))
        mgmtd_port = await nursery.start(
            RpcServer(secret, [mgmtd], name="mgmtd").serve, "127.0.0.1", 0
        )
        config = MetaConfig(
            listen="127.0.0.1:0",
            mgmtd=f"127.0.0.1:{mgmtd_port}",
            data_dir=str(tmp_path / "meta"),
            secret_file=str(secret_file),
            sync=False,
            map_size=64 << 20,
        )

        # a pending cut left by a crash is carried out at startup
        with NamespaceStore(tmp_path / "meta" / "namespace", map_size=64 << 20) as ns:
            f = ns.mknod(ROOT, b"f", 0o644, 0, 0, 0, lambda: {"chunk_size": 4096, "chains": [1]})
            ns.update_length(f["ino"], 1 << 20)
            ns.setattr(f["ino"], size=10)

        def cut_done() -> bool:
            return storage.targets_called("truncate", f["ino"]) == {101}  # chain 1's head

        for run in range(2):
            async with trio.open_nursery() as server_nursery:
                address = await server_nursery.start(functools.partial(serve, config))
                meta = MetaStub(rpc, address)
                assert (await meta.lookup(ROOT, b"f"))["ino"] == f["ino"]
                if run == 0:
                    await eventually(cut_done)
                    await eventually(lambda: mgmtd.heartbeats > 0)
                server_nursery.cancel_scope.cancel()
            assert len(mgmtd.unregistered) == run + 1  # a clean stop says goodbye
        nursery.cancel_scope.cancel()
    assert [r["node_id"] for r in mgmtd.registrations] == [None, 7]  # rejoined as itself
    assert [r["cluster_id"] for r in mgmtd.registrations] == [None, "test-cluster"]
    assert {r["kind"] for r in mgmtd.registrations} == {"meta"}
    assert mgmtd.unregistered == [7, 7]
    state = json.loads((tmp_path / "meta" / "node.json").read_text())
    assert state == {"node_id": 7, "cluster_id": "test-cluster"}
    with NamespaceStore(tmp_path / "meta" / "namespace", map_size=64 << 20) as ns:
        assert ns.truncate_jobs() == [] and ns.fsck() == []


def test_config_file_and_addresses(tmp_path: Path) -> None:
    path = tmp_path / "meta.toml"
    path.write_text(
        'listen = "0.0.0.0:7000"\nmgmtd = "10.0.0.1:7001"\n'
        'data_dir = "/srv/meta"\nsecret_file = "/etc/shufflefs/secret"\nsession_timeout = 30\n'
    )
    config = load_config(path, MetaConfig)
    assert config.session_timeout == 30.0 and config.sync and config.advertise is None
    config.host = "meta-1.example"
    listen_host, _ = listen_address(config.listen)

    def advertised() -> str:  # as serve() registers it
        return advertised_address(listen_host, 7000, advertise=config.advertise, host=config.host)

    assert advertised() == "meta-1.example:7000"
    config.advertise = "10.0.0.2:7000"
    assert advertised() == "10.0.0.2:7000"
    for bad in ({"session_timeout": 0.0}, {"map_size": 4096}, {"mgmtd": "nohost"}):
        with pytest.raises(FsError) as info:
            dataclasses.replace(config, **bad).validate(str(path))
        assert info.value.code == errno.EINVAL and str(path) in info.value.message
    path.write_text(path.read_text() + "map_size = 4096\n")
    with pytest.raises(FsError) as info:  # load_config runs the same checks
        load_config(path, MetaConfig)
    assert info.value.code == errno.EINVAL and "map_size" in info.value.message
    path.write_text('listen = "x"\nbogus = 1\n')
    with pytest.raises(FsError) as info:
        load_config(path, MetaConfig)
    assert info.value.code == errno.EINVAL
    with pytest.raises(FsError) as info:
        main(str(tmp_path / "missing.toml"))
    assert info.value.code == errno.ENOENT
    secret = tmp_path / "secret"
    generate_secret(secret)
    assert load_secret(secret)
