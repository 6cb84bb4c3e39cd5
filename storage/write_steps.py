"""The steps of one write at a replica, shared by the lone (`write`,
`replicate`) and the batched (`write_many`, `replicate_many`) handlers:
staging it here (its flush deferred, run in a worker thread by the target's
`UpdateQueue`) and what the head tells its successor about it."""

from __future__ import annotations

import errno

from shufflefs.rpc import FsError
from shufflefs.storage.forwarding import ForwardedUpdate
from shufflefs.storage.layout import check_chunk_size
from shufflefs.storage.protocol import NEED_FULL
from shufflefs.storage.staging import Staged, space_needed
from shufflefs.storage.store import ChunkStore


def stage_forwarded(
    store: ChunkStore,
    chunk: bytes,
    offset: int,
    chunk_size: int,
    version: int,
    full: bool,
    data: bytes | bytearray | memoryview,
) -> Staged:
    """Stage an update forwarded by the predecessor, its flush deferred (in
    a worker thread). A delta that meets a damaged block asks for the whole
    chunk instead (`NEED_FULL`), which heals it."""
    if full:
        return store.stage_replace(chunk, data, chunk_size, version, False)
    try:
        return store.stage_write(chunk, offset, data, chunk_size, version, False)
    except FsError as exc:
        if exc.code != errno.EIO:
            raise
        raise FsError(NEED_FULL, f"{exc.message}: send the whole chunk") from None


class OwnCopyDamaged(FsError):
    """The head's own copy could not stage a write (EIO: a damaged block
    under a partial overwrite). Raised in the worker thread, so that the
    loop tells it from the same errno of a flush or a commit (a disk
    failing, not one chunk to repair)."""


def stage_at_head(
    store: ChunkStore,
    chunk: bytes,
    offset: int,
    data: bytes | bytearray | memoryview,
    chunk_size: int,
) -> Staged:
    """A client's write staged at the head, its flush deferred (in a worker
    thread)."""
    try:
        return store.stage_write(chunk, offset, data, chunk_size, None, False)
    except FsError as exc:
        if exc.code != errno.EIO:
            raise
        raise OwnCopyDamaged(exc.code, exc.message) from None


def head_update(
    store: ChunkStore, chunk: bytes, offset: int, chunk_size: int, length: int
) -> ForwardedUpdate | None:
    """What the head's write of *length* bytes at *offset* tells its
    successor: the next version of the chunk's committed record (read here,
    under the chunk's lock, so it holds until the commit). None when
    nothing is forwarded: a zero-length write changes nothing, and one that
    stage refuses (it does not fit the chunk, or the chunk has another chunk
    size) fails here alone. ENOSPC without room for it here (never staged
    here alone: it would commit on this replica only)."""
    try:
        check_chunk_size(chunk_size)
    except FsError:
        return None
    if length == 0 or offset < 0 or offset + length > chunk_size:
        return None
    rec = store.committed(chunk)
    if rec is not None and rec.chunk_size != chunk_size:
        return None
    store.check_room(space_needed(rec, offset, length))
    current = rec.version if rec is not None else 0
    return ForwardedUpdate(chunk, offset, chunk_size, current + 1, current, False)
