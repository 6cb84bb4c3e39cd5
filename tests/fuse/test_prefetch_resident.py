"""Warm epochs' hints skipped while the kernel holds their files, and when
the mount stops trusting that (fuse/prefetch_resident.py): the decisions
alone, as the mount's reads and closes would drive them."""

from __future__ import annotations

from shufflefs.fuse.prefetch_hints import Hint
from shufflefs.fuse.prefetch_resident import RESOLVED, SPAN, ResidentSkips

SIZE = 110_000


def hint(ino: int) -> Hint:
    return Hint(ino, 0, None, version=(SIZE, 1, 1))


def held(ino: int, version: object, end: int) -> bool:
    return True  # the kernel holds every file, as far as the mount knows


def inos(hints: list[Hint]) -> list[int]:
    return [h.ino for h in hints]


def test_files_read_from_the_page_cache_keep_the_hints_skipped() -> None:
    skips = ResidentSkips(held)
    for i in range(100):
        assert skips.skip(hint(i))
        skips.taken(i)  # opened, read by the kernel, closed: no read here
    for i in range(100, 110):  # the odd file evicted: one in ten
        assert skips.skip(hint(i))
        assert skips.missed(i) == []
    assert skips.skip(hint(200))


def test_every_file_evicted_fetches_the_next_ones_and_stops_skipping() -> None:
    """The files were read (or closed) from the page cache before, then the
    kernel dropped them all: the reads of the next epoch reach the mount."""
    skips = ResidentSkips(held)
    for i in range(120):
        skips.skip(hint(i))
    for i in range(120):
        skips.taken(i)  # e.g. opened and closed to drop their pages
    for i in range(120):
        assert skips.skip(hint(i))  # the next epoch, hinted 120 ahead
    again: list[Hint] = []
    reads = 0
    while not again:
        again = skips.missed(reads)
        reads += 1
    # once one in two of the last RESOLVED known was evicted
    assert reads == RESOLVED // 2
    assert inos(again) == list(range(reads, 120))  # the rest, in order
    assert not skips.skip(hint(5))  # and hints are fetched for a while


def test_a_burst_of_evicted_files_in_a_warm_epoch_costs_one_span() -> None:
    """A dataset that just fits the page cache, read through a cache=immutable
    mount (no closes): the kernel drops the files read first last epoch,
    which are read first again; the rest of the epoch stays skipped."""
    skips = ResidentSkips(held)
    files = 20_000
    for i in range(files):  # the last epoch: every hint skipped, no read here
        assert skips.skip(hint(i))
    ahead = 2048
    for i in range(ahead):  # this epoch: hints run 2,048 ahead of the reads
        skips.skip(hint(i))
    fetched = 0
    for i in range(files):
        # the oldest 46 were evicted, and one in 400 of the rest
        if i < 46 or (i % 400 == 0 and i in skips.skipped):
            fetched += len(skips.missed(i))
        if i + ahead < files:
            fetched += not skips.skip(hint(i + ahead))
    assert fetched <= 2 * SPAN  # fetched after all, or not skipped: not the epoch
    assert skips.skip(hint(0))


def test_a_dataset_larger_than_the_page_cache_is_fetched_nearly_whole() -> None:
    skips = ResidentSkips(held)
    files = 20_000
    ahead = 512
    for i in range(ahead):
        skips.skip(hint(i))
    prefetched: set[int] = set()
    missed = 0
    for i in range(files):
        if i in skips.skipped:  # every file is gone from the kernel's cache
            missed += 1
            prefetched.update(inos(skips.missed(i)))
        if i + ahead < files and not skips.skip(hint(i + ahead)):
            prefetched.add(i + ahead)
    assert missed + len(prefetched) == files
    assert missed < files // 50  # the span doubles while every read misses


def test_a_file_hinted_again_is_awaited_where_its_last_hint_puts_it() -> None:
    """A cache=immutable mount: the next epoch's hints of files read from
    the page cache last epoch (never closed here) are new, in a new order."""
    skips = ResidentSkips(held)
    for i in range(3000):
        skips.skip(hint(i))
    order = list(range(2999, -1, -1))  # the next epoch's order
    for n, i in enumerate(order):
        skips.skip(hint(i))
        if n % 100 == 0:
            assert skips.missed(i) == []  # one in a hundred evicted
    assert skips.skip(hint(0))
