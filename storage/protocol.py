"""The storage daemon's wire protocol: chunk ids, message shapes, a typed stub.

A chunk is identified by (inode, chunk index), packed as 12 bytes big-endian;
its hex form names the chunk's file on a target. Bulk bytes always travel as
the frame's raw payload, never inside msgpack.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Sequence
from typing import Any, TypedDict

from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer

CHUNK_ID = struct.Struct(">QI")
CHUNK_ID_LEN = CHUNK_ID.size  # 12


def chunk_id(ino: int, index: int) -> bytes:
    return CHUNK_ID.pack(ino, index)


def split_chunk_id(cid: bytes) -> tuple[int, int]:
    if len(cid) != CHUNK_ID_LEN:
        raise FsError(errno.EINVAL, f"chunk id must be {CHUNK_ID_LEN} bytes, got {len(cid)}")
    ino, index = CHUNK_ID.unpack(cid)
    return int(ino), int(index)


# One range to read: [target_id, chunk_id, offset in chunk, length].
ReadItem = tuple[int, bytes, int, int]


class WriteResult(TypedDict):
    version: int  # the chunk's version after this write (rises by one per update)
    length: int  # the chunk's committed length after this write


class ChunkInfo(TypedDict):
    chunk: bytes
    version: int
    length: int
    block_size: int
    crcs: bytes  # CRC-32C of each block, 4 bytes big-endian each


class ChunkPage(TypedDict):
    chunks: list[ChunkInfo]
    more: bool


class TargetStats(TypedDict):
    target_id: int
    capacity: int
    free: int
    used: int
    chunks: int


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
        resp = await self.rpc.request(
            self.address,
            "read",
            {"items": [list(i) for i in items]},
            timeout=timeout or self.timeout,
        )
        return list(resp.result["lengths"]), resp.payload or bytearray()

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

    async def truncate_file(self, target: int, ino: int, size: int, chunk_size: int) -> int:
        """Cut every chunk of file *ino* held by *target* to a file size of
        *size*: chunks wholly past it are removed, the one it falls in is
        shortened. Returns the number of chunks changed."""
        result = await self._call(
            "truncate_file", target=target, ino=ino, size=size, chunk_size=chunk_size
        )
        return int(result["changed"])

    async def remove_file(self, target: int, ino: int) -> int:
        """Remove every chunk of file *ino* held by *target* (garbage
        collection after the last unlink and close). Returns how many."""
        result = await self._call("remove_file", target=target, ino=ino)
        return int(result["removed"])

    async def chunk_info(self, target: int, chunk: bytes) -> ChunkInfo:
        """One chunk's version, length and block checksums (ENOENT if absent)."""
        result: ChunkInfo = await self._call("chunk_info", target=target, chunk=chunk)
        return result

    async def list_chunks(
        self, target: int, after: bytes | None = None, limit: int = 1000
    ) -> ChunkPage:
        """Chunks of a target in chunk-id order, starting after *after*."""
        result: ChunkPage = await self._call("list_chunks", target=target, after=after, limit=limit)
        return result

    async def stats(self) -> list[TargetStats]:
        result = await self._call("stats")
        return list(result["targets"])

    async def _call(self, method: str, **args: Any) -> Any:
        return await self.rpc.call(self.address, method, args, timeout=self.timeout)
