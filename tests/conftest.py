"""Shared fixtures: a real local cluster, mounted with FUSE, for end-to-end tests.

The cluster is started with the real `shufflefs up` command (mgmtd, a metadata
server and three storage daemons as separate processes on loopback) and stopped
with `shufflefs down`, which signals them by pid. One cluster serves the whole
session; tests that kill or restart processes make their own.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from chains import SECRET, ChainCluster
from harness import shufflefs

from shufflefs.rpc import open_rpc_client


@dataclass
class Mounted:
    data_dir: Path
    mountpoint: Path

    @property
    def client_config(self) -> Path:
        return self.data_dir / "client.toml"


def require_fuse() -> None:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.fail("end-to-end tests need root and /dev/fuse (run via `make test` as root)")


@pytest.fixture(scope="session")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    require_fuse()
    base = tmp_path_factory.mktemp("cluster")
    m = Mounted(base / "data", base / "mnt")
    shufflefs("up", "--data-dir", str(m.data_dir), "--mountpoint", str(m.mountpoint))
    try:
        yield m
    finally:
        shufflefs("down", "--data-dir", str(m.data_dir), check=False)


@pytest.fixture
def mnt(mounted: Mounted, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory inside the shared mount, for one test."""
    d = mounted.mountpoint / request.node.name.replace("/", "_")[:100]
    d.mkdir()
    yield d


@pytest.fixture
def native(mounted: Mounted) -> Iterator[object]:
    from shufflefs.client import Client

    with Client(mounted.client_config) as c:
        yield c


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ChainCluster]:
    """Three storage daemons and a real mgmtd in this process (`ChainCluster`)."""
    async with open_rpc_client(SECRET) as rpc, trio.open_nursery() as nursery:
        c = ChainCluster(tmp_path, nursery, rpc)
        await c.start(nodes=3)
        yield c
        nursery.cancel_scope.cancel()
