"""Chain replication bookkeeping of a storage node, apart from the rpc handlers.

* `LockTable`: the locks that order updates. Every update of a chunk (a
  write, a forwarded write, a resync copy, a repair) holds the chunk's lock
  from stage to commit and its file's lock shared; truncate_file and
  remove_file hold the file's lock exclusively. On the head this orders every
  update of a file; replicas see them in that order because each is
  forwarded while the head still holds its locks.
* `Place`: where a target stands in a chain at the chain version a request
  carried (its successor, how many replicas follow, whether it is syncing).
* `SyncState`: what a syncing target knows while resync runs (which chunks
  are verified, which the chain changed since a copy was read).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import trio

from shufflefs.cluster.protocol import ChainInfo, TargetInfo
from shufflefs.cluster.routing import Routing
from shufflefs.storage.protocol import ChunkInfo

# ---- locks -----------------------------------------------------------------


class RWLock:
    """A shared/exclusive lock for trio tasks. Writes of a file hold its lock
    shared (each also holds its chunk's lock); truncate and remove hold it
    exclusively. A waiting exclusive holder keeps new shared holders out, so a
    stream of writes cannot starve a truncation."""

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0

    async def acquire_shared(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while self.writer or self.writers_waiting:
            await self._lot.park()
        self.readers += 1

    def release_shared(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._lot.unpark_all()

    async def acquire_exclusive(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.writers_waiting += 1
        try:
            while self.writer or self.readers:
                await self._lot.park()
        finally:
            self.writers_waiting -= 1
            self._lot.unpark_all()  # shared waiters re-check (we may have been cancelled)
        self.writer = True

    def release_exclusive(self) -> None:
        self.writer = False
        self._lot.unpark_all()


class LockTable:
    """The locks of one storage node, created on demand and dropped when
    nobody holds or waits for them. Order: a file's lock, then a chunk's."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, int], tuple[RWLock, list[int]]] = {}
        self._chunks: dict[tuple[int, bytes], tuple[trio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def _file(self, target: int, ino: int, exclusive: bool) -> AsyncIterator[None]:
        key = (target, ino)
        lock, users = self._files.setdefault(key, (RWLock(), [0]))
        users[0] += 1
        try:
            if exclusive:
                await lock.acquire_exclusive()
            else:
                await lock.acquire_shared()
            try:
                yield
            finally:
                if exclusive:
                    lock.release_exclusive()
                else:
                    lock.release_shared()
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._files[key]

    @contextlib.asynccontextmanager
    async def _chunk(self, target: int, cid: bytes) -> AsyncIterator[None]:
        key = (target, cid)
        lock, users = self._chunks.setdefault(key, (trio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._chunks[key]

    @contextlib.asynccontextmanager
    async def update(self, target: int, cid: bytes) -> AsyncIterator[None]:
        """Held by everything that changes or copies one chunk, from stage to commit."""
        async with self._file(target, ino_of(cid), False), self._chunk(target, cid):
            yield

    @contextlib.asynccontextmanager
    async def updates(self, target: int, cids: Sequence[bytes]) -> AsyncIterator[None]:
        """`update` of many chunks at once (a batch of writes): every file's
        lock once, in order, then every chunk's, in order. Taking a file's
        lock a second time could wait behind a truncation queued meanwhile
        for the first; the order keeps batches and lone updates from
        waiting on each other in a circle."""
        async with contextlib.AsyncExitStack() as stack:
            for ino in sorted({ino_of(cid) for cid in cids}):
                await stack.enter_async_context(self._file(target, ino, False))
            for cid in sorted(set(cids)):
                await stack.enter_async_context(self._chunk(target, cid))
            yield

    @contextlib.asynccontextmanager
    async def whole_file(self, target: int, ino: int) -> AsyncIterator[None]:
        """Held by truncate_file and remove_file: no update of the file runs meanwhile."""
        async with self._file(target, ino, True):
            yield

    def __len__(self) -> int:
        """Locks held or waited for (others are dropped)."""
        return len(self._files) + len(self._chunks)


def ino_of(cid: bytes) -> int:
    return int.from_bytes(cid[:8], "big")


def same_info(a: ChunkInfo, b: ChunkInfo) -> bool:
    """Do two replicas hold the same chunk? Version and length must agree, and
    the checksums when both targets use one block size (otherwise the caller
    compares bytes)."""
    return (
        a["version"] == b["version"]
        and a["length"] == b["length"]
        and a["block_size"] == b["block_size"]
        and a["crcs"] == b["crcs"]
    )


def chain_of(routing: Routing, target: int) -> ChainInfo | None:
    for chain in routing.chains.values():
        if target in chain["targets"]:
            return chain
    return None


# ---- where a call stands in its chain ----------------------------------------


@dataclass
class Place:
    """This target's position in a chain at the version a request carried."""

    routing: Routing
    chain: int
    version: int
    members: list[TargetInfo]  # the chain's write targets: serving, then syncing, in order
    index: int

    @property
    def successor(self) -> TargetInfo | None:
        return self.members[self.index + 1] if self.index + 1 < len(self.members) else None

    @property
    def remaining(self) -> int:
        """Replicas after this one."""
        return len(self.members) - self.index - 1

    @property
    def syncing(self) -> bool:
        return self.members[self.index]["state"] == "syncing"


# ---- resync bookkeeping ----------------------------------------------------------


class SyncState:
    """What a syncing target knows while it is being brought up to date, for
    one chain version (a new version starts afresh: the target may have
    missed updates in between).

    * ``trusted``: chunks known to equal the chain's: copied by resync, found
      identical to the source, or set by a forwarded update that was whole or
      built on a trusted chunk. Resync skips them. A forwarded delta to any
      other chunk is applied (its version matched) but proves nothing: the
      version number alone does not identify the bytes (a chunk removed and
      written again restarts at version 1), so resync still compares it.
    * ``touched``: a sequence number per chunk and per file of the last change
      the chain (or a repair) made here; a resync copy read from the source
      before such a change is not installed but read again (else it would
      undo the change here, which the source applies only after us)."""

    def __init__(self, chain: int, chain_version: int) -> None:
        self.chain = chain
        self.chain_version = chain_version
        self.trusted: set[bytes] = set()
        self.seq = 0
        self.touched: dict[bytes, int] = {}
        self.touched_files: dict[int, int] = {}
        self.forwarded = 0  # updates the chain sent while we synced

    def touch(self, cid: bytes) -> None:
        self.seq += 1
        self.touched[cid] = self.seq

    def touch_file(self, ino: int) -> None:
        self.seq += 1
        self.touched_files[ino] = self.seq

    def touched_since(self, cid: bytes, seq: int) -> bool:
        return self.touched.get(cid, 0) > seq or self.touched_files.get(ino_of(cid), 0) > seq


@dataclass
class ResyncStats:
    target: int
    chain: int
    source: int
    chunks_checked: int = 0
    chunks_copied: int = 0
    bytes_copied: int = 0
    chunks_deleted: int = 0
    forwarded: int = 0
    seconds: float = 0.0
