"""What the file-level commands (`info`, `warmup`, `import`) share: naming a file
by its path on a mount or in the cluster, and a client session to read it.

``/mnt/shufflefs/data/x`` (a path on a shufflefs mount of this machine) and
``/data/x`` (a path inside the cluster) name the same file; a path on no
shufflefs mount is taken as a cluster path, so scripts on a host without a
mount work too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.preflight import mount_of
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import RoutingCache
from shufflefs.rpc.client import RpcClient

T = TypeVar("T")

FSTYPE = "fuse.shufflefs"
# an admin command fails within seconds when a service is down, not after
# the 30 s a training job's reads keep retrying
ADMIN_OPTIONS = ClientOptions(meta_timeout=5.0, read_timeout=10.0, retry_budget=8.0)


def cluster_path(path: str) -> str:
    """The path inside the cluster of *path* (see the module docstring). A
    path that does not exist yet (where `import` is to put a tree) is on a
    mount if its nearest existing ancestor is."""
    absolute = os.path.abspath(path)
    existing, rest = absolute, ""
    while not os.path.exists(existing) and existing != "/":
        existing, name = os.path.split(existing)
        rest = os.path.join(name, rest) if rest else name
    mount = mount_of(existing)
    if mount is not None and mount.fstype == FSTYPE:
        rel = os.path.relpath(os.path.join(os.path.realpath(existing), rest), mount.point)
        return "/" if rel == "." else "/" + rel
    return "/" + path.lstrip("/") if not path.startswith("/") else path


def with_filesystem(
    args: argparse.Namespace,
    fn: Callable[[FileSystem, MgmtdStub, RpcClient], Awaitable[T]],
    options: ClientOptions = ADMIN_OPTIONS,
) -> T:
    """Run *fn* with a started client of the cluster (a metadata session;
    closed again after), reporting an unreachable service in one line."""

    async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> T:
        async with trio.open_nursery() as nursery:
            fs = FileSystem(rpc, RoutingCache(rpc, mgmtd.address), options)
            await fs.start(nursery)
            try:
                return await fn(fs, mgmtd, rpc)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await fs.close()
                nursery.cancel_scope.cancel()

    return with_mgmtd(args, run)
