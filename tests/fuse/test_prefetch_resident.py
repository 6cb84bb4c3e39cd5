"""Warm epochs' hints skipped while the kernel holds their files, and when
the mount stops trusting that (fuse/prefetch_resident.py)."""

from __future__ import annotations

import trio

from shufflefs.fuse.prefetch_hints import Hint
from shufflefs.fuse.prefetch_resident import SKIP_WINDOW, ResidentSkips

SIZE = 110_000


def hint(ino: int) -> Hint:
    return Hint(ino, 0, None, version=(SIZE, 1, 1))


def held(ino: int, version: object, end: int) -> bool:
    return True  # the kernel holds every file, as far as the mount knows


def run(check: object) -> None:
    trio.run(check)  # type: ignore[arg-type]  # (trio's clock for the distrust)


def test_a_file_hinted_again_before_its_read_counts_once() -> None:
    async def check() -> None:
        skips = ResidentSkips(held)
        for _ in range(3):  # a loader hinting the same window three times
            assert all(skips.skip(hint(i)) for i in range(11))
        # the kernel dropped them all: its reads reach the mount
        for i in range(5):
            assert skips.missed(i) == []  # 5 of 11: not yet one in two
        again = skips.missed(5)
        assert [h.ino for h in again] == [6, 7, 8, 9, 10]  # the rest, fetched after all
        assert not skips.skip(hint(1))  # and no hint skipped meanwhile

    run(check)


def test_a_burst_of_evicted_files_in_a_warm_epoch_keeps_skipping() -> None:
    """A dataset that just fits the page cache: the kernel drops the files
    read first last epoch, which are read first again."""

    async def check() -> None:
        skips = ResidentSkips(held)
        for i in range(2048):  # four readers hinting 512 ahead each
            assert skips.skip(hint(i))
        for i in range(200):  # the oldest 200 were evicted
            assert skips.missed(i) == []
            assert skips.skip(hint(2048 + i))  # each read, one more hint
        assert skips.skip(hint(5000))

    run(check)


def test_a_dataset_larger_than_the_page_cache_is_fetched_after_all() -> None:
    async def check() -> None:
        skips = ResidentSkips(held)
        for i in range(2048):
            skips.skip(hint(i))
        again: list[Hint] = []
        reads = 0
        while not again:
            again = skips.missed(reads)  # every file gone from the kernel's cache
            skips.skip(hint(2048 + reads))
            reads += 1
        assert reads <= SKIP_WINDOW  # within a window's reads
        assert len(again) > 1000 and reads - 1 not in {h.ino for h in again}
        assert not skips.skip(hint(9999))

    run(check)


def test_an_epoch_later_the_same_files_count_again() -> None:
    """A cache=immutable mount sees no opens or closes: a skipped file read
    from the kernel's cache stays listed; its next epoch's hint is a new
    decision, not a repeat."""

    async def check() -> None:
        skips = ResidentSkips(held)
        for _ in range(2):  # two epochs of 3,000 files read from the kernel's cache
            for i in range(3000):
                assert skips.skip(hint(i))
        for i in range(100):  # then a burst of 100 evicted: one in 30, not in two
            assert skips.missed(i) == []
        assert skips.skip(hint(0))

    run(check)
