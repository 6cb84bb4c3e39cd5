"""The storage daemon's wire protocol: chunk ids, message shapes, a typed stub.

A chunk is identified by (inode, chunk index), packed as 12 bytes big-endian;
its hex form names the chunk's file on a target. Bulk bytes always travel as
the frame's raw payload, never inside msgpack.

Clients send `write` (or many at once, `write_many`), and the metadata server
`truncate_file`/`remove_file`/`remove_files`, to the head of a chain; replicas
forward them with `replicate` (`replicate_many`) / `replicate_truncate` /
`replicate_remove` / `replicate_remove_files` (the protocol: docs/storage.md,
"Chain replication" and "Batched writes"). Errors a caller acts on:

* ``ESTALE``: the chain version is not the daemon's (the caller refreshes its
  routing map and retries), the target is not where the call belongs in the
  chain, or a successor was unreachable (it has been reported to mgmtd; retry
  once the chain changed).
* ``EROFS``: the chain has fewer serving targets than the cluster's
  ``min_replicas``; writes wait until a replica is back.
* `NEED_FULL` (``EBADE``): answered by a replica to a `replicate` whose
  ``base_version`` is not its committed version (it missed an update, or is
  being resynced and has not verified the chunk yet). The sender resends the
  whole new chunk with ``full=True``.

How long a caller of a chain's head waits is fixed here, once, for every
caller (the client's writes, the metadata server's truncates and removals)
and for the daemons' own forwards: `chain_call_timeout`.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Sequence
from typing import Any, TypedDict

from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer

# A replica's answer to an update built on a version it does not hold: send
# the whole chunk instead ("invalid exchange").
NEED_FULL = errno.EBADE

# Seconds a replica waits for its successor, per replica still ahead of it:
# the head of a 3-chain waits 20 s, its middle 10 s, so the nearest live hop
# times out first and the failure is reported by the replica next to it.
FORWARD_TIMEOUT = 10.0
SYNC_BARRIER_TIMEOUT = 20.0  # a source waiting out its updates at an older chain version


def chain_call_timeout(replicas: int, forward_timeout: float = FORWARD_TIMEOUT) -> float:
    """How long the caller of a chain's head waits for its answer: one
    forward timeout more than the head waits for the rest of the chain
    (``forward_timeout`` x the *replicas* after it), so the head's ESTALE for an
    unreachable replica always arrives before the caller gives up."""
    return forward_timeout * max(1, replicas)


CHUNK_ID = struct.Struct(">QI")
CHUNK_ID_LEN = CHUNK_ID.size  # 12


def chunk_id(ino: int, index: int) -> bytes:
    return CHUNK_ID.pack(ino, index)


# One range to read: [target_id, chunk_id, offset in chunk, length].
ReadItem = tuple[int, bytes, int, int]
# Items one `read` request may carry (EMSGSIZE past it: split the request);
# keeps a request's body well under the frame's 1 MiB (~30 bytes an item).
MAX_READ_ITEMS = 8192
# Files one `remove_files` may name (EINVAL past it); the metadata server's
# garbage collection sends freed files in batches of up to this many
MAX_FILES_REMOVED = 1024


class WriteResult(TypedDict):
    version: int  # the chunk's version after this write (rises by one per update)
    length: int  # the chunk's committed length after this write


# One write of `write_many`: [target (the chain's head), chain, chain_version,
# chunk_id, offset in chunk, chunk_size, length]; its bytes are the next
# *length* bytes of the frame's payload (the items' bytes end to end).
WriteItem = tuple[int, int, int, bytes, int, int, int]
# One update of `replicate_many`: [target, chain, chain_version, chunk_id,
# offset, chunk_size, version, base_version, full, length], as `replicate`.
ReplicateItem = tuple[int, int, int, bytes, int, int, int, int, bool, int]
# Writes one `write_many` / `replicate_many` may carry (EMSGSIZE past it).
MAX_WRITE_ITEMS = 256
# Per item of a `write_many` / `replicate_many`: [0, version, length] once
# durable on every serving replica, else [errno, message] (that item only).
WriteOutcome = list[int | str]


def write_outcome(result: WriteResult | FsError) -> WriteOutcome:
    """An item's answer on the wire."""
    if isinstance(result, FsError):
        return [result.code or errno.EIO, result.message]
    return [0, result["version"], result["length"]]


def outcome_result(outcome: Sequence[Any]) -> WriteResult | FsError:
    """`write_outcome` read back (EPROTO for anything malformed)."""
    try:
        code = int(outcome[0])
        if code:
            return FsError(code, str(outcome[1]))
        return {"version": int(outcome[1]), "length": int(outcome[2])}
    except (TypeError, ValueError, IndexError):
        return FsError(errno.EPROTO, f"malformed write outcome {outcome!r:.80}")


class ChunkInfo(TypedDict):
    chunk: bytes
    version: int
    length: int
    block_size: int
    crcs: bytes  # CRC-32C of each block, 4 bytes big-endian each


class ChunkPage(TypedDict):
    chunks: list[ChunkInfo]
    more: bool


class ChunkMeta(TypedDict):
    """What `read_chunk` returns beside the chunk's bytes."""

    version: int
    length: int
    chunk_size: int


class ScrubResult(TypedDict):
    checked: int  # chunks whose every block was verified
    corrupt: int  # of those, chunks with a damaged or missing block
    divergent: int  # chunks whose version or checksums differ from the chain's head
    repaired: int  # corrupt or divergent chunks fixed from another replica
    unrecoverable: int  # damaged chunks no healthy replica could fix
    next: bytes | None  # cursor for the next page (the last chunk checked), None at the end


class TargetStats(TypedDict):
    target_id: int
    capacity: int
    free: int
    used: int
    chunks: int


async def read_items(
    rpc: RpcClient, address: str, items: Sequence[ReadItem], timeout: float
) -> tuple[list[int], bytearray]:
    """`StorageStub.read`, without a stub (the client's read path: one call
    per frame, no object to build). The items go as they are (msgpack packs
    a tuple as the array a list would be)."""
    resp = await rpc.request(address, "read", {"items": items}, timeout=timeout)
    lengths: list[int] = resp.result["lengths"]
    return lengths, resp.payload or bytearray()


async def _many(
    rpc: RpcClient,
    address: str,
    method: str,
    items: Sequence[Any],
    data: Sequence[Buffer],
    timeout: float,
) -> list[WriteResult | FsError]:
    result = await rpc.call(address, method, {"items": items}, payload=data, timeout=timeout)
    outcomes = result.get("outcomes") if isinstance(result, dict) else None
    if not isinstance(outcomes, list) or len(outcomes) != len(items):
        raise FsError(errno.EPROTO, f"{address} answered {method} of {len(items)} items wrongly")
    return [outcome_result(o) for o in outcomes]


class StorageStub:
    """Typed calls to the storage daemon at one address."""

    def __init__(self, rpc: RpcClient, address: str, timeout: float = 10.0) -> None:
        self.rpc = rpc
        self.address = address
        self.timeout = timeout

    async def read(
        self, items: Sequence[ReadItem], timeout: float | None = None
    ) -> tuple[list[int], bytearray]:
        """Read many ranges in one request. Returns, per item, the number of
        bytes delivered (short when the range runs past the chunk's end; 0 for
        a chunk that does not exist) or a negative errno for an item that
        failed (EIO: its checksum did not match; the bytes are never returned),
        and one payload holding the delivered bytes of all items in order."""
        return await read_items(self.rpc, self.address, items, timeout or self.timeout)

    async def write(
        self,
        target: int,
        chain: int,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        data: Buffer,
        timeout: float | None = None,
    ) -> WriteResult:
        """Write *data* at *offset* of a chunk, through the chain whose head is
        *target*. Acknowledged only once durable on every serving replica.
        offset + len(data) must not exceed chunk_size. A gap between the
        chunk's end and *offset* reads as zeros."""
        result: WriteResult = await self.rpc.call(
            self.address,
            "write",
            {
                "target": target,
                "chain": chain,
                "chain_version": chain_version,
                "chunk": chunk,
                "offset": offset,
                "chunk_size": chunk_size,
            },
            payload=data,
            timeout=timeout or self.timeout,
        )
        return result

    async def replicate(
        self,
        target: int,
        chain: int,
        chain_version: int,
        chunk: bytes,
        offset: int,
        chunk_size: int,
        version: int,
        base_version: int,
        full: bool,
        data: Buffer,
        timeout: float | None = None,
    ) -> WriteResult:
        """Storage to storage: stage an update of a chunk on the next replica
        of the chain, which forwards it to its own successor and commits once
        that one acknowledged. *version* is the version the update produces;
        a delta (``full=False``: *data* at *offset*) applies only on
        *base_version*, else the replica answers `NEED_FULL` and the caller
        resends the whole new chunk (``full=True``, *offset* 0)."""
        result: WriteResult = await self.rpc.call(
            self.address,
            "replicate",
            {
                "target": target,
                "chain": chain,
                "chain_version": chain_version,
                "chunk": chunk,
                "offset": offset,
                "chunk_size": chunk_size,
                "version": version,
                "base_version": base_version,
                "full": full,
            },
            payload=data,
            timeout=timeout or self.timeout,
        )
        return result

    async def write_many(
        self, items: Sequence[WriteItem], data: Sequence[Buffer], timeout: float | None = None
    ) -> list[WriteResult | FsError]:
        """Many `write`s in one request (each to the head of its chain, each
        chunk at most once): per item its result or its error. *data*: each
        item's bytes, in order."""
        return await _many(
            self.rpc, self.address, "write_many", items, data, timeout or self.timeout
        )

    async def replicate_many(
        self, items: Sequence[ReplicateItem], data: Sequence[Buffer], timeout: float | None = None
    ) -> list[WriteResult | FsError]:
        """Storage to storage: many `replicate`s in one request (what a
        replica forwards of one `write_many`): per item its result or error
        (`NEED_FULL` among them: resend that one whole)."""
        return await _many(
            self.rpc, self.address, "replicate_many", items, data, timeout or self.timeout
        )

    async def truncate_file(
        self, target: int, chain: int, chain_version: int, ino: int, size: int, chunk_size: int
    ) -> int:
        """Cut every chunk of file *ino* on *chain* to a file size of *size*
        (chunks wholly past it are removed, the one it falls in is shortened),
        on every replica: sent to the chain's head (*target*), ordered with
        writes. Returns the number of chunks the head changed."""
        result = await self._call(
            "truncate_file",
            target=target,
            chain=chain,
            chain_version=chain_version,
            ino=ino,
            size=size,
            chunk_size=chunk_size,
        )
        return int(result["changed"])

    async def remove_file(self, target: int, chain: int, chain_version: int, ino: int) -> int:
        """Remove every chunk of file *ino* on *chain*, on every replica (sent
        to the chain's head, *target*; garbage collection after the last
        unlink and close). Returns how many chunks the head removed."""
        return await self._removed(
            "remove_file", target=target, chain=chain, chain_version=chain_version, ino=ino
        )

    async def remove_files(
        self, target: int, chain: int, chain_version: int, inos: list[int]
    ) -> int:
        """`remove_file` of each of *inos* (at most MAX_FILES_REMOVED) in one
        call: what garbage collection sends for a batch of freed files.
        Returns how many chunks the head removed."""
        return await self._removed(
            "remove_files", target=target, chain=chain, chain_version=chain_version, inos=inos
        )

    async def replicate_remove_files(
        self, target: int, chain: int, chain_version: int, inos: list[int]
    ) -> int:
        """Storage to storage: `remove_files` on the next replica of the chain."""
        return await self._removed(
            "replicate_remove_files",
            target=target,
            chain=chain,
            chain_version=chain_version,
            inos=inos,
        )

    async def replicate_truncate(
        self, target: int, chain: int, chain_version: int, ino: int, size: int, chunk_size: int
    ) -> int:
        """Storage to storage: `truncate_file` on the next replica of the chain."""
        result = await self._call(
            "replicate_truncate",
            target=target,
            chain=chain,
            chain_version=chain_version,
            ino=ino,
            size=size,
            chunk_size=chunk_size,
        )
        return int(result["changed"])

    async def replicate_remove(self, target: int, chain: int, chain_version: int, ino: int) -> int:
        """Storage to storage: `remove_file` on the next replica of the chain."""
        return await self._removed(
            "replicate_remove", target=target, chain=chain, chain_version=chain_version, ino=ino
        )

    async def read_chunk(
        self, target: int, chunk: bytes, timeout: float | None = None
    ) -> tuple[ChunkMeta, bytearray]:
        """A whole committed chunk, every block verified, with its version
        (resync and repair copy chunks with it). Waits for an update of the
        chunk in flight on this replica. ENOENT if the chunk does not exist,
        EIO if it is damaged here."""
        resp = await self.rpc.request(
            self.address,
            "read_chunk",
            {"target": target, "chunk": chunk},
            timeout=timeout or self.timeout,
        )
        meta: ChunkMeta = resp.result
        return meta, resp.payload or bytearray()

    async def scrub(
        self, target: int, after: bytes | None = None, limit: int = 64, timeout: float | None = None
    ) -> ScrubResult:
        """Verify every block of up to *limit* chunks after *after* (id
        order), compare them with the chain's head, repair what is damaged or
        divergent from a healthy replica. Page on with the returned ``next``."""
        result: ScrubResult = await self.rpc.call(
            self.address,
            "scrub",
            {"target": target, "after": after, "limit": limit},
            timeout=timeout or self.timeout,
        )
        return result

    async def add_target(self, path: str, timeout: float | None = None) -> int:
        """Format (or open) the directory *path* on this storage node as a new
        target, keep serving it across restarts, and register it with mgmtd.
        Returns its target id."""
        result = await self.rpc.call(
            self.address, "add_target", {"path": path}, timeout=timeout or self.timeout
        )
        return int(result["target_id"])

    async def chunk_info(self, target: int, chunk: bytes) -> ChunkInfo:
        """One chunk's version, length and block checksums (ENOENT if absent)."""
        result: ChunkInfo = await self._call("chunk_info", target=target, chunk=chunk)
        return result

    async def sync_barrier(self, target: int, chain: int, chain_version: int) -> None:
        """Wait until *target* takes updates of *chain* at *chain_version* and
        those it took at an older version are done (a syncing tail, before it
        compares with this source)."""
        await self._call("sync_barrier", target=target, chain=chain, chain_version=chain_version)

    async def list_chunks(
        self, target: int, after: bytes | None = None, limit: int = 1000
    ) -> ChunkPage:
        """Chunks of a target in chunk-id order, starting after *after*."""
        result: ChunkPage = await self._call("list_chunks", target=target, after=after, limit=limit)
        return result

    async def stats(self) -> list[TargetStats]:
        result = await self._call("stats")
        return list(result["targets"])

    async def _removed(self, method: str, **args: Any) -> int:
        """A removal's call: how many chunks it removed."""
        return int((await self._call(method, **args))["removed"])

    async def _call(self, method: str, **args: Any) -> Any:
        return await self.rpc.call(self.address, method, args, timeout=self.timeout)
