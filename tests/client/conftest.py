"""The client core against a real cluster in this process: the `cluster`
fixture's mgmtd and three storage daemons (tests/chains.py), plus, for
`FileSystem`, the real metadata server (`metadata.process.serve`) registered
with that mgmtd. No FUSE, no subprocess."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio
from clusters import ChainCluster

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.config import MetaConfig
from shufflefs.metadata.process import serve


async def start_meta(cluster: ChainCluster, data_dir: Path) -> None:
    """A metadata server in the cluster's nursery; mgmtd's map names it on return."""
    config = MetaConfig(
        listen="127.0.0.1:0",
        mgmtd=cluster.mgmtd_address,
        data_dir=str(data_dir),
        secret_file=str(cluster.secret_file),
        sync=False,
        map_size=64 << 20,
    )
    await cluster.nursery.start(functools.partial(serve, config))
    await cluster.sync_maps()


@pytest.fixture
async def meta_cluster(cluster: ChainCluster, tmp_path: Path) -> AsyncIterator[ChainCluster]:
    """`cluster` with a metadata server."""
    await start_meta(cluster, tmp_path / "meta")
    yield cluster


OpenFs = Callable[[ClientOptions], Awaitable[FileSystem]]


@pytest.fixture
async def open_fs(meta_cluster: ChainCluster) -> AsyncIterator[OpenFs]:
    """Opens started `FileSystem`s (another client each; background tasks in
    the cluster's nursery), closed at the end of the test."""
    opened: list[FileSystem] = []

    async def open_one(options: ClientOptions) -> FileSystem:
        routing = RoutingCache(meta_cluster.rpc, meta_cluster.mgmtd_address)
        fs = FileSystem(meta_cluster.rpc, routing, options)
        await fs.start(meta_cluster.nursery)
        opened.append(fs)
        return fs

    yield open_one
    for fs in opened:
        with trio.move_on_after(5):
            await fs.close()


@pytest.fixture
async def fs(open_fs: OpenFs) -> FileSystem:
    """A FileSystem through the daemons only (no short circuit), retrying briefly."""
    return await open_fs(ClientOptions(local_reads=False, retry_budget=3.0))
