"""The metadata calls behind a client's read-only opens and their cache
(client/open_cache.py): overlapping ones batched (client/open_batch.py),
handles given back many at a time, each with its fallback for a metadata
server of before it (ENOSYS)."""

from __future__ import annotations

import errno

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.open_batch import Batcher
from shufflefs.client.session import Session
from shufflefs.metadata.protocol import Attr, OpenResult
from shufflefs.rpc.errors import FsError


class ReadOnlyCalls:
    def __init__(self, meta: MetaClient, session: Session) -> None:
        self.meta = meta
        self.session = session
        self.attr_batch: Batcher[int, Attr] = Batcher(
            lambda ino: meta.call_idempotent("getattr", lambda m: m.getattr(ino)),
            lambda inos: meta.call_idempotent("getattrs", lambda m: m.getattrs(inos)),
            "getattr",
        )
        self.open_batch: Batcher[tuple[int, int], OpenResult] = Batcher(
            lambda key: session.call("open", lambda m, s: m.open(key[0], key[1], s)),
            self.open_many,
            "open",
        )
        self._batch_release = True  # until a metadata server answers ENOSYS
        self._lookup_open = True  # the same

    async def fresh_attr(self, ino: int) -> Attr:
        """Attributes from the primary (a follower may not have applied
        another client's change yet): what an open revalidates a cached file
        with (close-to-open); concurrent ones go in one call."""
        return await self.attr_batch.get(ino)

    async def open(self, ino: int, flags: int) -> OpenResult:
        """A read-only open; concurrent ones go in one call."""
        return await self.open_batch.get((ino, flags))

    async def open_many(self, keys: list[tuple[int, int]]) -> list[OpenResult | None]:
        opens = [[ino, flags] for ino, flags in keys]
        return await self.session.call("open_read_only", lambda m, s: m.open_read_only(opens, s))

    async def lookup_open(self, parent: int, name: bytes) -> OpenResult | None:
        """`lookup` and, for a regular file, a read-only open in one call
        (None: the metadata server has no such call; look up instead)."""
        if not self._lookup_open:
            return None
        try:
            return await self.session.call(
                "lookup_open", lambda m, s: m.lookup_open(parent, name, s)
            )
        except FsError as exc:
            if exc.code != errno.ENOSYS:
                raise
            self._lookup_open = False
            return None

    async def release(self, ino: int, handle: int) -> None:
        await self.meta.call_at_most_once(
            "release", lambda m: m.release(ino, handle, self.session.id)
        )

    async def release_many(self, pairs: list[tuple[int, int]]) -> None:
        """Read-only handles given back in one call (`release` each from a
        metadata server of before `release_read_only`)."""
        if self._batch_release:
            handles = [[ino, handle] for ino, handle in pairs]
            try:
                await self.meta.call_at_most_once(
                    "release_read_only",
                    lambda m: m.release_read_only(handles, self.session.id),
                )
                return
            except FsError as exc:
                if exc.code != errno.ENOSYS:
                    raise
                self._batch_release = False
        for ino, handle in pairs:
            await self.release(ino, handle)
