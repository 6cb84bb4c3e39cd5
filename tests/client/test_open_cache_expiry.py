"""Which cached read-only handles `OpenCache.expire` gives back: those idle
for `linger`, and the oldest idle ones beyond `limit`; never one in use. The
cache keeps its idle entries in the order they became idle (an open takes
one out, its close puts it last), so expiry looks at the oldest only."""

from __future__ import annotations

import trio
import trio.testing

from shufflefs.client.open_cache import OpenCache
from shufflefs.metadata.protocol import Attr, OpenResult


def attr(ino: int) -> Attr:
    return Attr(
        ino=ino, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0,
        atime=0, mtime=0, ctime=0, parent=0, change=1,
    )  # fmt: skip


def cache(released: list[int], limit: int, linger: float) -> OpenCache:
    async def getattr(ino: int) -> Attr:
        return attr(ino)

    async def open_fresh(ino: int, flags: int) -> OpenResult:
        return {"attr": attr(ino), "layout": None, "handle": 1000 + ino}

    async def release(ino: int, handle: int) -> None:
        released.append(ino)

    async def release_many(pairs: list[tuple[int, int]]) -> None:
        released.extend(ino for ino, _ in pairs)

    return OpenCache(
        getattr, open_fresh, release, release_many=release_many,
        trust=True, linger=linger, limit=limit,
    )  # fmt: skip


def test_expiry_gives_back_the_oldest_idle_handles_and_none_in_use() -> None:
    clock = trio.testing.MockClock()

    async def main() -> None:
        released: list[int] = []
        c = cache(released, limit=3, linger=10.0)
        entries = {}
        for ino in (1, 2, 3, 4, 5):
            entries[ino], _ = await c.open(ino, 0)
            clock.jump(1.0)
        for ino in (1, 2, 3, 4):
            await c.close(entries[ino])
            clock.jump(1.0)
        # 5 cached, limit 3: the two oldest idle ones go; 5 is in use
        assert await c.expire() == 2
        assert released == [1, 2]
        # 3 is opened again (in use: never given back) and closed after 4
        again, _ = await c.open(3, 0)
        clock.jump(1.0)
        await c.close(again)
        await c.close(entries[5])
        assert await c.expire() == 0
        assert sorted(c.entries) == [3, 4, 5]
        # 4 became idle first, then 3, then 5: they linger out in that order
        clock.jump(9.0)  # 4 idle since 8 s, 3 and 5 since 10 s: now 19 s
        assert await c.expire() == 1 and released == [1, 2, 4]
        clock.jump(1.0)
        assert await c.expire() == 2 and released == [1, 2, 4, 3, 5]
        assert c.entries == {}

    trio.run(main, clock=clock)
