"""Catching a follower up by snapshot, when the log cannot.

A follower whose position the primary's log does not match (it missed more
than the log still holds, or it holds entries a deposed primary never got
acknowledged) gets a copy of the primary's whole LMDB environment: one
consistent read snapshot written with `env.copyfd` (the log position is in
it, in the same snapshot), sent in pieces; the follower writes it next to
its namespace, fsyncs it, and swaps it in for its `data.mdb` (its own
environment closed meanwhile), then takes the log from that position on.
Entries it held that the primary never had are dropped with the old file.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

import trio

from shufflefs.metadata.store import NamespaceStore
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import fsync_dir

log = logging.getLogger("shufflefs.metadata.replication")

PIECE = 8 << 20
SNAPSHOT_TIMEOUT = 30.0  # per piece


async def send_snapshot(store: NamespaceStore, rpc: RpcClient, address: str, epoch: int) -> None:
    """Copy our namespace to the follower at *address*."""
    fd, name = tempfile.mkstemp(prefix="snapshot-", dir=store.path.parent)
    try:
        await trio.to_thread.run_sync(store.env.copyfd, fd)
        size = os.fstat(fd).st_size
        log.info("sending a snapshot of %d bytes to %s", size, address)
        offset = 0
        while True:
            piece = await trio.to_thread.run_sync(os.pread, fd, PIECE, offset)
            done = offset + len(piece) >= size
            args = {"epoch": epoch, "offset": offset, "done": done}
            await rpc.call(address, "repl_snapshot", args, payload=piece, timeout=SNAPSHOT_TIMEOUT)
            offset += len(piece)
            if done:
                return
    finally:
        os.close(fd)
        os.unlink(name)


class SnapshotReceiver:
    """The follower's side: pieces into a file beside the namespace, then
    the swap (on the event loop: no read may run on a closed environment)."""

    def __init__(self, store: NamespaceStore) -> None:
        self.store = store
        self.path = store.path.parent / "namespace.recv"

    def _write(self, offset: int, data: bytes, done: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if offset != os.fstat(fd).st_size:
                raise FsError(errno.EINVAL, f"snapshot piece at {offset} out of order")
            os.pwrite(fd, data, offset)
            if done:
                os.fsync(fd)
        finally:
            os.close(fd)

    async def piece(self, offset: int, data: bytes, done: bool) -> bool:
        """Returns whether the snapshot is now installed."""
        await trio.to_thread.run_sync(self._write, offset, data, done)
        if not done:
            return False
        self.install(self.path)
        return True

    def install(self, data_file: Path) -> None:
        store = self.store
        store.env.close()
        os.replace(data_file, store.path / "data.mdb")
        fsync_dir(store.path)
        store.open_env()
        log.info("installed a snapshot: applied seq %d", store.txns.last_seq)
