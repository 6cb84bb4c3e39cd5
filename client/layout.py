"""Where a file's bytes live: the ONE chunk planner.

Chunk ``k`` of a file lives on ``chains[k % len(chains)]``; with the layout in
hand a client computes every byte's place without asking anyone. Every read
(the async engine, the blocking native path, the short-circuit fast path) and
every write (write-behind and direct) splits its ranges here, with `plan`.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id

MAX_CHUNKS = 1 << 32

Extent = tuple[int, Layout, int, int]  # (inode, layout, offset in the file, length)
# (chain, chunk id, offset in the chunk, length, where the bytes are in the
# caller's buffer: the extents laid end to end). Plain tuples and inline
# arithmetic: a batch is thousands of extents, and this runs per batch.
Piece = tuple[int, bytes, int, int, int]


def plan(extents: Sequence[Extent]) -> list[Piece]:
    """The chunk pieces of *extents*, in order, each with the position its
    bytes take in the caller's buffer (the extents laid end to end)."""
    pieces: list[Piece] = []
    append = pieces.append
    dst = 0
    for ino, layout, offset, length in extents:
        if offset < 0 or length < 0:
            raise FsError(errno.EINVAL, "negative offset or length")
        size = layout["chunk_size"]
        chains = layout["chains"]
        if not chains:
            raise FsError(errno.EIO, f"file {ino} has a layout without chains")
        pos, end = offset, offset + length
        while pos < end:
            index = pos // size
            if index >= MAX_CHUNKS:
                raise FsError(errno.EFBIG, "offset beyond the largest possible file")
            within = pos - index * size
            n = min(size - within, end - pos)
            append(
                (chains[index % len(chains)], chunk_id(ino, index), within, n, dst + pos - offset)
            )
            pos += n
        dst += length
    return pieces
