"""`shufflefs bench --remote --rounds N`: each fio row summarized from its
rounds, its ratios taken within each round (the peer beside us in time)."""

from __future__ import annotations

from shufflefs.client.iobench_remote import FioRow, summarize


def row(where: str, jobs: int, iops: float, p50: float = 100.0) -> FioRow:
    return FioRow(where, jobs, iops, p50, 2 * p50)


def test_rounds_give_medians_and_the_spread_of_each_rounds_ratio() -> None:
    runs = {
        ("shufflefs", 1): [row("shufflefs", 1, 2000, 400), row("shufflefs", 1, 3000, 300),
                           row("shufflefs", 1, 1000, 900)],
        ("local", 1): [row("local", 1, 10000), row("local", 1, 10000), row("local", 1, 5000)],
        ("fuse:/m", 1): [row("fuse:/m", 1, 4000), row("fuse:/m", 1, 3000),
                         row("fuse:/m", 1, 2000)],
    }  # fmt: skip
    rows = {(r.where, r.jobs): r for r in summarize(runs, "fuse:/m")}
    ours = rows[("shufflefs", 1)]
    # the round of median IOPS, its latencies with it
    assert (ours.iops, ours.p50_us, ours.rounds) == (2000, 400, 3)
    assert ours.iops_range == (1000, 3000)
    # per round 0.5, 1.0, 0.5 of the peer: not 2000 / 3000
    assert ours.ratio_to_compare == 0.5
    assert ours.ratio_to_compare_range == (0.5, 1.0)
    # per round 0.2, 0.3, 0.2 of local
    assert ours.ratio_to_local == 0.2
    assert ours.ratio_to_local_range == (0.2, 0.3)
    assert rows[("fuse:/m", 1)].ratio_to_compare == 1.0
    assert rows[("local", 1)].ratio_to_local == 1.0


def test_one_round_has_no_spread_and_no_compare_without_a_peer() -> None:
    runs = {
        ("shufflefs", 8): [row("shufflefs", 8, 6000)],
        ("local", 8): [row("local", 8, 40000)],
    }
    (ours, local) = summarize(runs, None)
    assert ours.rounds == 1 and ours.iops_range is None and ours.ratio_to_local_range is None
    assert ours.ratio_to_local == 0.15 and ours.ratio_to_compare is None
    assert local.ratio_to_local == 1.0
