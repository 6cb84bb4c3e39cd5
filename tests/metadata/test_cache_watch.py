"""The metadata server's side of cache watches (metadata/cache_watch.py), on
trio's virtual clock: who is told of a change, when a writer may go on, and
what a server that just began must wait out. The client's side, against a
real server, is in tests/client/test_open_cache.py."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shufflefs.metadata.cache_watch import MARGIN, MAX_DIRS, CacheWatches
from shufflefs.metadata.txn import merge_dirs

LEASE, POLL = 3.0, 1.0


class Holders:
    """What ReadOnlyHandles would say."""

    def __init__(self) -> None:
        self.readers: dict[int, list[int]] = {}
        self.unknown = False
        self.earlier: set[int] = set()

    def watches(self) -> CacheWatches:
        return CacheWatches(
            lambda ino: self.readers.get(ino, []),
            lambda: self.unknown,
            lambda session: session in self.earlier,
            lambda: bool(self.earlier),
            lease=LEASE,
            poll=POLL,
        )


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def run(clock: trio.testing.MockClock, fn: object) -> None:
    trio.run(fn, clock=clock)  # type: ignore[arg-type]


def test_a_change_reaches_the_watching_reader_before_the_writer_goes_on(
    clock: trio.testing.MockClock,
) -> None:
    holders = Holders()
    holders.readers = {7: [1], 8: [2]}

    async def main() -> None:
        watches = holders.watches()
        watches.begin()
        first = await watches.watch(1, 0, 0)  # a new watcher: answered at once
        assert first["changed"] == [] and first["lease"] == LEASE and trio.current_time() == 0
        token = first["token"]
        # nothing to tell: answered after a poll
        idle = await watches.watch(1, token, first["seq"])
        assert idle["changed"] == [] and trio.current_time() == POLL
        events: list[str] = []
        acknowledged_at: list[float] = []

        async def writer() -> None:
            await watches.changed({7: 5, 9: 2})  # 9: nobody caches it
            events.append("acknowledged to the writer")
            acknowledged_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            reply = await watches.watch(1, token, idle["seq"])  # woken by the change
            assert reply["changed"] == [[7, 5]] and trio.current_time() == POLL
            events.append("told the reader")
            await trio.sleep(0.2)
            assert events == ["told the reader"]  # waits for the acknowledgement
            with trio.move_on_after(0.1):
                await watches.watch(1, token, reply["seq"])  # the acknowledgement
        assert events == ["told the reader", "acknowledged to the writer"]
        assert acknowledged_at == [pytest.approx(POLL + 0.2)]  # when the ack came
        # a change of a file only another session caches, with no watch: no wait
        now = trio.current_time()
        await watches.changed({8: 3})
        assert trio.current_time() == now

    run(clock, main)


def test_an_unacknowledged_change_is_sent_again_and_a_silent_reader_costs_one_lease(
    clock: trio.testing.MockClock,
) -> None:
    holders = Holders()
    holders.readers = {7: [1]}

    async def main() -> None:
        watches = holders.watches()
        watches.begin()
        first = await watches.watch(1, 0, 0)
        asked_at = trio.current_time()
        await trio.sleep(0.5)
        await watches.changed({7: 2})  # the reader never asks again
        # its lease ran from when its last answered request arrived
        assert trio.current_time() == pytest.approx(asked_at + LEASE + MARGIN)
        # it comes back: the change is sent (again), and acknowledged
        again = await watches.watch(1, first["token"], first["seq"])
        assert again["changed"] == [[7, 2]]
        done = await watches.watch(1, first["token"], 0)  # an old ack changes nothing
        assert done["changed"] == [[7, 2]]

    run(clock, main)


def test_a_stale_token_is_answered_at_once_with_the_watchers_own(
    clock: trio.testing.MockClock,
) -> None:
    async def main() -> None:
        watches = Holders().watches()
        watches.begin()
        first = await watches.watch(1, 0, 0)
        stale = await watches.watch(1, first["token"] + 1, 99)
        assert stale["token"] == first["token"] and trio.current_time() == 0
        watches.forget(1)  # the session ended
        fresh = await watches.watch(1, first["token"], 0)
        assert fresh["token"] != first["token"] and trio.current_time() == 0

    run(clock, main)


def test_a_server_that_just_began_waits_out_what_an_earlier_one_granted(
    clock: trio.testing.MockClock,
) -> None:
    """Sessions from before this server (restart, promotion) may trust a
    cache an earlier server kept fresh: their files' writers wait until one
    lease after the start. Sessions new to it, or a later change, do not."""
    holders = Holders()
    holders.readers = {7: [1], 8: [2]}
    holders.earlier = {1}

    async def main() -> None:
        watches = holders.watches()
        await trio.sleep(10)
        watches.begin()
        await watches.changed({8: 1})  # session 2 is new: nothing to wait for
        assert trio.current_time() == 10
        await watches.changed({7: 1})
        assert trio.current_time() == pytest.approx(10 + LEASE + MARGIN)
        await watches.changed({7: 2})  # the grace is over
        assert trio.current_time() == pytest.approx(10 + LEASE + MARGIN)

        watches.begin()  # promoted again; holders not all re-reported yet
        holders.unknown = True
        start = trio.current_time()
        await watches.changed({9: 1})  # anyone may cache it
        assert trio.current_time() == pytest.approx(start + LEASE + MARGIN)

    run(clock, main)


def test_a_watched_listing_is_told_once_and_a_new_server_waits_for_earlier_ones(
    clock: trio.testing.MockClock,
) -> None:
    """A directory's next change is told to every session watching its
    listing, once; a session that ends, or watches too many, is not told;
    after a (re)start, a directory's change waits out the lease while any
    session from before lives (what it watched is not re-reported)."""
    holders = Holders()

    async def main() -> None:
        watches = holders.watches()
        watches.begin()
        token = (await watches.watch(1, 0, 0))["token"]
        assert (
            watches.watch_dir(1, 40, 6) == 6 and watches.watch_dir(2, 40, 6) == 6
        )  # 2: no watcher
        seen: list[list[list[int]]] = []

        async def reader() -> None:
            acked = 0
            while True:
                reply = await watches.watch(1, token, acked)
                acked = reply["seq"]
                if reply["changed"]:
                    seen.append(reply["changed"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.1)
            start = trio.current_time()
            await watches.changed({}, {40: 7})
            assert seen == [[[40, 7]]] and trio.current_time() - start < POLL
            await watches.changed({}, {40: 8})  # not watched any more: nobody told
            assert seen == [[[40, 7]]]
            # a session that read the change already is not told of it (its
            # commit's notice came after the read), nor dropped; one that
            # watched from before keeps the older counter (the client then
            # does not trust what it read now) and is told
            assert watches.watch_dir(1, 40, 9) == 9
            await watches.changed({}, {40: 9})
            assert seen == [[[40, 7]]] and watches.dirs[40] == {1: 9}
            assert watches.watch_dir(1, 40, 10) == 9
            await watches.changed({}, {40: 10})
            assert seen == [[[40, 7]], [[40, 10]]] and 40 not in watches.dirs
            assert watches.watch_dir(1, 41, 1) == 1
            watches.forget(1)
            assert 41 not in watches.dirs
            nursery.cancel_scope.cancel()
        for ino in range(MAX_DIRS):
            assert watches.watch_dir(3, ino, 1) == 1
        assert watches.watch_dir(3, MAX_DIRS, 1) is None  # beyond the bound: not watched
        assert watches.watch_dir(3, 5, 2) == 1  # one it watches already
        watches.forget(3)
        assert watches.dirs == {}

        holders.earlier = {9}
        watches.begin()
        start = trio.current_time()
        await watches.changed({8: 1})  # a file nobody from before holds: no wait
        assert trio.current_time() == start
        await watches.changed({}, {40: 9})  # 9 may watch it through the earlier server
        assert trio.current_time() == pytest.approx(start + LEASE + MARGIN)

    run(clock, main)


def test_a_sessions_own_create_is_not_told_to_it_and_its_watch_goes_on(
    clock: trio.testing.MockClock,
) -> None:
    """A directory change one session alone made (a create names its
    session) is not told to that session if its client keeps names (it
    said so with `watch_dir`), which goes on watching from that change:
    the next change by another is told to it (and to the others at once);
    a change two sessions made in one commit is told to both; a client of
    before (no `names`) is told of its own creates as of any change."""
    holders = Holders()

    async def main() -> None:
        watches = holders.watches()
        watches.begin()
        tokens = {s: (await watches.watch(s, 0, 0))["token"] for s in (1, 2)}
        seen: dict[int, list[list[int]]] = {1: [], 2: []}

        async def reader(session: int) -> None:
            acked = 0
            while True:
                reply = await watches.watch(session, tokens[session], acked)
                acked = reply["seq"]
                seen[session].extend(reply["changed"])

        async with trio.open_nursery() as nursery:
            for s in (1, 2):
                nursery.start_soon(reader, s)
                assert watches.watch_dir(s, 40, 6, names=True) == 6
            await trio.sleep(0.1)
            start = trio.current_time()
            await watches.changed({}, {40: 7}, {40: 1})  # 1's own create
            assert seen == {1: [], 2: [[40, 7]]} and trio.current_time() - start < POLL
            assert watches.dirs[40] == {1: 7}  # 1 still watches, from 7; 2 told once
            await watches.changed({}, {40: 8}, {40: 1})
            assert seen[1] == [] and watches.dirs[40] == {1: 8}
            await watches.changed({}, {40: 9}, {40: 2})  # another's: told
            assert seen[1] == [[40, 9]] and 40 not in watches.dirs
            for s in (1, 2):
                assert watches.watch_dir(s, 40, 9) == 9
            await watches.changed({}, {40: 11}, {40: None})  # two sessions' commit
            assert seen == {1: [[40, 9], [40, 11]], 2: [[40, 7], [40, 11]]}
            # a session whose client never said it keeps names: told of its own
            tokens[3] = (await watches.watch(3, 0, 0))["token"]
            seen[3] = []
            nursery.start_soon(reader, 3)
            await trio.sleep(0.1)
            assert watches.watch_dir(3, 40, 11) == 11
            await watches.changed({}, {40: 12}, {40: 3})
            assert seen[3] == [[40, 12]] and 3 not in watches.dirs.get(40, {})
            nursery.cancel_scope.cancel()

    run(clock, main)


def merge(
    into: dict[int, int], into_by: dict[int, int | None], dirs: dict[int, int], by: int | None
) -> None:
    """`merge_dirs` of changes one session (or none named) made."""
    merge_dirs(into, into_by, dirs, dict.fromkeys(dirs, by))


def test_a_directorys_one_changer_is_kept_through_groups_and_commits() -> None:
    """`merge_dirs`: a directory keeps its changer while only that session
    changes it; another session's change, or one that names none, makes
    it None for good (until taken)."""
    dirs: dict[int, int] = {}
    by: dict[int, int | None] = {}
    merge(dirs, by, {40: 7, 41: 3}, 1)
    merge(dirs, by, {40: 8}, 1)
    assert dirs == {40: 8, 41: 3} and by == {40: 1, 41: 1}
    merge(dirs, by, {41: 4}, 2)
    merge(dirs, by, {42: 1}, None)
    merge(dirs, by, {42: 2}, 1)
    assert dirs == {40: 8, 41: 4, 42: 2} and by == {40: 1, 41: None, 42: None}
