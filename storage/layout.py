"""A target's on-disk layout: ``target.json``, the chunk record, file names.

::

    <target>/target.json          format, block_size, target_id, cluster_id
    <target>/meta/                LMDB env: db "chunks" (chunk id -> record), db "stats"
    <target>/chunks/<xx>/<chunk id hex>.<generation>

``<xx>`` is the low byte of the inode xor the low byte of the chunk index, in
hex, so both many one-chunk files and one many-chunk file spread over the 256
directories. Everything here is pure (no I/O but the small json helpers) so
the record format can be tested and documented on its own.
"""

from __future__ import annotations

import errno
import struct
from array import array
from dataclasses import dataclass
from typing import Any

from shufflefs.rpc.errors import FsError
from shufflefs.storage.crc import crcs_from_bytes, crcs_to_bytes
from shufflefs.storage.protocol import CHUNK_ID_LEN

FORMAT_VERSION = 1
TARGET_FILE = "target.json"
META_DIR = "meta"
CHUNKS_DIR = "chunks"

MAX_CHUNK_SIZE = 64 << 20
MIN_BLOCK_SIZE = 512
MAX_BLOCK_SIZE = 1 << 20

RECORD_FORMAT = 1
# format u8 | version u64 | generation u64 | length u32 | chunk_size u32, then 4-byte BE CRCs
RECORD_HEADER = struct.Struct(">BQQII")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_block_size(block_size: int) -> None:
    if not is_power_of_two(block_size) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise FsError(
            errno.EINVAL,
            f"block size {block_size} must be a power of two "
            f"in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
        )


def check_chunk_size(chunk_size: int) -> None:
    if not is_power_of_two(chunk_size) or chunk_size > MAX_CHUNK_SIZE:
        raise FsError(
            errno.EINVAL,
            f"chunk size {chunk_size} must be a power of two of at most {MAX_CHUNK_SIZE}",
        )


def check_chunk_id(cid: Any) -> None:
    if not isinstance(cid, bytes) or len(cid) != CHUNK_ID_LEN:
        got = len(cid) if isinstance(cid, bytes) else type(cid).__name__
        raise FsError(errno.EINVAL, f"chunk id must be {CHUNK_ID_LEN} bytes, got {got}")


def block_count(length: int, block_size: int) -> int:
    return (length + block_size - 1) // block_size


def block_span(
    offset: int, length: int, committed: int, block_size: int
) -> tuple[int, int, int, int] | None:
    """What a read of ``[offset, offset + length)`` from a chunk with
    *committed* bytes must fetch to verify its checksums: (first block,
    byte start, byte stop, end of the bytes returned); None when the range
    holds no committed byte."""
    end = min(offset + length, committed)
    if end <= offset:
        return None
    first = offset // block_size
    return first, first * block_size, min(block_count(end, block_size) * block_size, committed), end


def chunk_dir_name(cid: bytes) -> str:
    return f"{cid[7] ^ cid[11]:02x}"


def chunk_file_name(cid: bytes, generation: int) -> str:
    return f"{cid.hex()}.{generation}"


def parse_chunk_file_name(name: str) -> tuple[bytes, int] | None:
    """(chunk id, generation) of a chunk file name, None for anything else."""
    stem, dot, gen = name.partition(".")
    if not dot or len(stem) != 2 * CHUNK_ID_LEN or not gen.isdigit():
        return None
    try:
        return bytes.fromhex(stem), int(gen)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """The committed state of one chunk (the LMDB value under its id).

    Bytes of the chunk file past ``length`` are never trusted: they are the
    remains of a write that did not commit."""

    version: int  # rises by one per update
    generation: int  # names the chunk file; changes on copy-on-write
    length: int  # committed length
    chunk_size: int  # of the file's layout: offset + length never passes it
    crcs: array[int]  # one per block of the committed length

    def encode(self) -> bytes:
        head = RECORD_HEADER.pack(
            RECORD_FORMAT, self.version, self.generation, self.length, self.chunk_size
        )
        return head + crcs_to_bytes(self.crcs)

    @classmethod
    def decode(cls, raw: bytes | memoryview, block_size: int) -> ChunkRecord:
        """Parse a stored record; a malformed one is EIO (never guessed at)."""
        if len(raw) < RECORD_HEADER.size:
            raise FsError(errno.EIO, f"chunk record too short ({len(raw)} bytes)")
        fmt, version, generation, length, chunk_size = RECORD_HEADER.unpack_from(raw)
        if fmt != RECORD_FORMAT:
            raise FsError(errno.EIO, f"unknown chunk record format {fmt}")
        nblocks = block_count(length, block_size)
        if len(raw) != RECORD_HEADER.size + 4 * nblocks or length > chunk_size:
            raise FsError(errno.EIO, f"malformed chunk record (length {length}, {len(raw)} bytes)")
        crcs = crcs_from_bytes(raw[RECORD_HEADER.size :])
        return cls(version, generation, length, chunk_size, crcs)

    def crc_bytes(self) -> bytes:
        return crcs_to_bytes(self.crcs)


def same_record(a: ChunkRecord | None, b: ChunkRecord | None) -> bool:
    """Is *a* still the chunk's state *b* (same version, file and length)?
    None is "no chunk"."""
    if a is None or b is None:
        return a is b
    return (a.version, a.generation, a.length) == (b.version, b.generation, b.length)
