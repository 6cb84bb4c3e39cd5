"""`Batcher` (client/open_batch.py) with a linger: a call nobody waits for
(a writeback mount's close carried out behind) waits a moment for others
to share it, and is sent at once when a caller that waits joins it. On
trio's mock clock, so the times are exact and the test takes none."""

from __future__ import annotations

import trio
import trio.testing

from shufflefs.client.open_batch import Batcher


class Calls:
    """The batcher's two calls, recorded with the (mock) time they were made."""

    def __init__(self) -> None:
        self.made: list[tuple[str, list[int], float]] = []

    async def one(self, key: int) -> int:
        self.made.append(("one", [key], trio.current_time()))
        await trio.sleep(0.001)
        return key * 10

    async def many(self, keys: list[int]) -> list[int | None]:
        self.made.append(("many", list(keys), trio.current_time()))
        await trio.sleep(0.001)
        return [k * 10 for k in keys]


def run(main: object) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_keys_asked_within_the_linger_share_one_call() -> None:
    calls = Calls()
    batcher = Batcher(calls.one, calls.many, "close")
    got: dict[int, int] = {}

    async def ask(key: int, after: float, linger: float) -> None:
        await trio.sleep(after)
        got[key] = await batcher.get(key, linger)

    async def main() -> None:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, 1, 0.0, 0.003)
            nursery.start_soon(ask, 2, 0.001, 0.003)
            nursery.start_soon(ask, 3, 0.002, 0.003)
        assert calls.made == [("many", [1, 2, 3], t0 + 0.003)]
        # one asked after the call left waits for the next
        await ask(4, 0.0, 0.003)
        assert calls.made[-1][:2] == ("many", [4])

    run(main)
    assert got == {1: 10, 2: 20, 3: 30, 4: 40}


def test_a_caller_that_waits_sends_the_gathering_call_at_once() -> None:
    calls = Calls()
    batcher = Batcher(calls.one, calls.many, "close")

    async def main() -> None:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.get, 1, 10.0)
            await trio.sleep(0.5)
            assert calls.made == []  # still gathering
            assert await batcher.get(2) == 20
        assert calls.made == [("many", [1, 2], t0 + 0.5)]

    run(main)


def test_without_linger_a_lone_call_goes_at_once() -> None:
    calls = Calls()
    batcher = Batcher(calls.one, calls.many, "close")

    async def main() -> None:
        t0 = trio.current_time()
        assert await batcher.get(5) == 50
        assert calls.made == [("one", [5], t0)]

    run(main)
