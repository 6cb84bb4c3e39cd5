"""Where a file's bytes live: (offset, length) -> chunk ranges.

Chunk ``k`` of a file lives on ``chains[k % len(chains)]``; with the layout in
hand a client computes every byte's place without asking anyone.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id

MAX_CHUNKS = 1 << 32


@dataclass(frozen=True, slots=True)
class ChunkRange:
    index: int  # chunk index within the file
    chain: int  # chain holding the chunk
    chunk: bytes  # 12-byte chunk id
    offset: int  # offset inside the chunk
    length: int
    file_offset: int  # where the range starts in the file


def chunk_ranges(ino: int, layout: Layout, offset: int, length: int) -> list[ChunkRange]:
    """Split [offset, offset + length) of file *ino* at chunk boundaries."""
    if offset < 0 or length < 0:
        raise FsError(errno.EINVAL, "negative offset or length")
    size = layout["chunk_size"]
    chains = layout["chains"]
    if not chains:
        raise FsError(errno.EIO, f"file {ino} has a layout without chains")
    out: list[ChunkRange] = []
    pos, end = offset, offset + length
    while pos < end:
        index = pos // size
        if index >= MAX_CHUNKS:
            raise FsError(errno.EFBIG, "offset beyond the largest possible file")
        within = pos - index * size
        n = min(size - within, end - pos)
        out.append(
            ChunkRange(index, chains[index % len(chains)], chunk_id(ino, index), within, n, pos)
        )
        pos += n
    return out
