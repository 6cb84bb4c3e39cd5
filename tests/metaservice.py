"""The metadata service (`MetaService`) behind a real RpcServer on loopback,
called through MetaStub over a real RpcClient, with a fake storage daemon
serving the two methods the service calls (tests/metadata use it as `env`)."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from shufflefs.cluster.protocol import RoutingInfo
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.server import MetaService
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError, RpcServer, open_rpc_client, rpc_method

SECRET = b"0123456789abcdef0123456789abcdef"
CHAINS = {1: [101, 102], 2: [103, 104], 3: [105, 106]}


def routing_info(storage_address: str, version: int = 1) -> RoutingInfo:
    """Two storage nodes, three chains of two targets each."""
    return {
        "version": version,
        "cluster_id": "test-cluster",
        "config": {
            "chunk_size": 1 << 20,
            "stripe": 2,
            "replicas": 2,
            "min_replicas": 2,
            "heartbeat_interval": 0.2,
            "heartbeat_timeout": 5.0,
        },
        "nodes": [
            {
                "id": n,
                "kind": "storage",
                "address": storage_address,
                "host": "localhost",
                "pid": 1,
                "state": "online",
                "last_seen": 0.0,
            }
            for n in (1, 2)
        ],
        "targets": [
            {
                "id": t,
                "node": 1 + t % 2,
                "path": f"/t{t}",
                "state": "serving",
                "capacity": 1 << 40,
                "free": 1 << 40,
                "used": 0,
                "chunks": 0,
            }
            for chain in CHAINS.values()
            for t in chain
        ],
        "chains": [{"id": c, "version": 1, "targets": t} for c, t in CHAINS.items()],
    }


class RoutingHolder:
    def __init__(self, info: RoutingInfo) -> None:
        self.info = info
        self.routing = Routing(info)

    def __call__(self) -> Routing:
        return self.routing

    def set_target_state(self, target: int, state: str) -> None:
        for t in self.info["targets"]:
            if t["id"] == target:
                t["state"] = state
        self.info["version"] += 1
        self.routing = Routing(self.info)


class FakeStorage:
    """The storage methods the metadata server calls, at a chain's head
    (a real chain of storage daemons: tests/metadata/test_storage_jobs.py)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.broken: set[int] = set()

    @rpc_method
    async def truncate_file(
        self, target: int, chain: int, chain_version: int, ino: int, size: int, chunk_size: int
    ) -> Any:
        if target in self.broken:
            raise FsError(errno.EIO, f"target {target} is broken")
        assert target == CHAINS[chain][0], "sent to a chain's head only"
        self.calls.append(("truncate", target, ino, size, chunk_size))
        return {"changed": 1}

    @rpc_method
    async def remove_file(self, target: int, chain: int, chain_version: int, ino: int) -> Any:
        if target in self.broken:
            raise FsError(errno.EIO, f"target {target} is broken")
        assert target == CHAINS[chain][0], "sent to a chain's head only"
        self.calls.append(("remove", target, ino))
        return {"removed": 3}

    @rpc_method
    async def remove_files(
        self, target: int, chain: int, chain_version: int, inos: list[int]
    ) -> Any:
        if target in self.broken:
            raise FsError(errno.EIO, f"target {target} is broken")
        assert target == CHAINS[chain][0], "sent to a chain's head only"
        self.calls.extend(("remove", target, ino) for ino in inos)
        return {"removed": 3 * len(inos)}

    def targets_called(self, kind: str, ino: int) -> set[int]:
        return {c[1] for c in self.calls if c[0] == kind and c[2] == ino}


class ShiftedClock:
    """The wall clock, plus however far a test moved it on."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class Env:
    meta: MetaStub
    service: MetaService
    store: NamespaceStore
    storage: FakeStorage
    routing: RoutingHolder
    session: int
    clock: ShiftedClock

    async def create(self, parent: int, name: bytes) -> tuple[int, int]:
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        r = await self.meta.create(parent, name, 0o644, flags, 0, 0, self.session)
        return r["attr"]["ino"], r["handle"]


@asynccontextmanager
async def service_env(store: NamespaceStore, clock: ShiftedClock) -> AsyncIterator[Env]:
    """The service over *store*, on loopback, with a fake storage daemon and
    a session of its own; fsck must pass when it ends."""
    storage = FakeStorage()
    async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
        port = await nursery.start(
            RpcServer(SECRET, [storage], name="storage").serve, "127.0.0.1", 0
        )
        routing = RoutingHolder(routing_info(f"127.0.0.1:{port}"))
        service = MetaService(store, routing, rpc, storage_timeout=2.0)
        service.jobs.base_delay = 0.0
        meta_port = await nursery.start(
            RpcServer(SECRET, [service], name="meta").serve, "127.0.0.1", 0
        )
        meta = MetaStub(rpc, f"127.0.0.1:{meta_port}")
        session = (await meta.session_open("test", "localhost", os.getpid()))["session"]
        yield Env(meta, service, store, storage, routing, session, clock)
        nursery.cancel_scope.cancel()
    assert store.fsck() == []


def open_store(path: Path, clock: ShiftedClock) -> NamespaceStore:
    return NamespaceStore(path, map_size=64 << 20, sync=False, session_timeout=60.0, clock=clock)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    """The service without its background duties: a test runs the storage-job
    pass (`service.jobs.run_once()`) and the session reaper
    (`service.reaper.reap_once()`) itself, so "nothing happened yet" is a
    fact, not a sleep. With no backoff, every pass retries every failed job."""
    clock = ShiftedClock()
    store = open_store(tmp_path / "ns", clock)
    try:
        async with service_env(store, clock) as e:
            yield e
    finally:
        store.close()
