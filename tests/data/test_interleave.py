"""The mixture's interleaving: exact proportions from the position alone, curricula."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shufflefs.client.data.interleave import Interleave, Schedule, proportions

proportion_lists = st.lists(st.integers(0, 40), min_size=2, max_size=5).filter(any)


def window_errors(comp: np.ndarray, k: int, weights: list[Fraction]) -> np.ndarray:
    """max over windows of |count - N * w| per component, for every window length N."""
    onehot = (comp[:, None] == np.arange(k)[None, :]).astype(np.int64)
    prefix = np.vstack([np.zeros((1, k), dtype=np.int64), np.cumsum(onehot, axis=0)])
    w = np.asarray([float(x) for x in weights])
    worst = np.zeros(k)
    for n in range(1, len(comp)):
        counts = prefix[n:] - prefix[:-n]
        worst = np.maximum(worst, np.abs(counts - n * w).max(axis=0))
    return worst


@settings(max_examples=60, deadline=None)
@given(a=proportion_lists, start=st.integers(0, 10**12))
def test_every_window_has_exact_proportions(a: list[int], start: int) -> None:
    """Two components: every window of N within one of N*w. More: within
    1 + (k-2)*w (the bound of the method; module docstring says why one is
    impossible in general)."""
    inter = Interleave(a)
    total = sum(a)
    weights = [Fraction(x, total) for x in a]
    length = min(6 * total + 13, 400)
    comp, index = inter.span(start, length)
    assert (comp >= 0).all()
    active = sum(1 for x in a if x)
    worst = window_errors(comp, len(a), weights)
    for i, w in enumerate(weights):
        bound = 1 if active <= 2 else 1 + (active - 2) * w
        assert worst[i] <= bound + 1e-9, (a, i, worst[i])
        # a component's samples come in its own order, without gaps
        mine = index[comp == i]
        assert (np.diff(mine) == 1).all()
        if mine.size:
            assert mine[0] == inter.counts(start)[i]
    # the counts before any position add up, and match the span
    before = inter.counts(start)
    after = inter.counts(start + length)
    assert sum(after) - sum(before) == length
    assert [int((comp == i).sum()) for i in range(len(a))] == [
        y - x for x, y in zip(before, after, strict=True)
    ]


def test_the_issues_weights_are_within_one_everywhere() -> None:
    a = proportions([0.5, 0.3, 0.2])
    assert a == (5, 3, 2)
    comp, _ = Interleave(a).span(0, 300)
    worst = window_errors(comp, 3, [Fraction(x, 10) for x in a])
    assert (worst <= 1).all()


def longest_order_within_one(a: tuple[int, ...], limit: int) -> int:
    """The longest order (up to *limit* positions) of components with integer
    proportions *a* in which every window of N positions holds each component
    within one of N * w (inclusive), by exhaustive search over all orders.

    A window's error is the difference of two prefix errors, so an order
    qualifies exactly when each component's prefix error (scaled by D to stay
    in integers) spans at most D."""
    total, k = sum(a), len(a)
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = set()
    best = 0

    def extend(n: int, dev: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
        nonlocal best
        best = max(best, n)
        if n == limit:
            return True
        if (n, dev, lo, hi) in seen:
            return False
        seen.add((n, dev, lo, hi))
        for j in range(k):
            nd = tuple(d + (total if i == j else 0) - a[i] for i, d in enumerate(dev))
            nlo = tuple(map(min, lo, nd))
            nhi = tuple(map(max, hi, nd))
            fits = all(h - low <= total for h, low in zip(nhi, nlo, strict=True))
            if fits and extend(n + 1, nd, nlo, nhi):
                return True
        return False

    zero = (0,) * k
    extend(0, zero, zero, zero)
    return best


def test_within_one_everywhere_is_impossible_for_some_three_way_weights() -> None:
    """Why the bound for three or more components is 1 + (k-2)*w and not 1:
    for 0.45/0.35/0.2 no order at all keeps every window within one (not even
    11 positions long), so no method can; where an order exists the search
    finds it (0.5/0.3/0.2, which ours meets: the test above)."""
    assert longest_order_within_one((9, 7, 4), 200) == 10
    assert longest_order_within_one((41, 33, 26), 200) == 16
    assert longest_order_within_one((5, 3, 2), 200) == 200
    assert longest_order_within_one((1, 1), 200) == 200
    # ours on the impossible weights: every window within the stated bound
    comp, _ = Interleave((9, 7, 4)).span(0, 300)
    worst = window_errors(comp, 3, [Fraction(x, 20) for x in (9, 7, 4)])
    assert all(worst[i] <= 1 + w / 20 + 1e-9 for i, w in enumerate((9, 7, 4)))


def test_proportions() -> None:
    assert proportions([1, 1, 1]) == (1, 1, 1)
    assert proportions([0.25, 0.75, 0]) == (1, 3, 0)
    odd = proportions([0.1234567, 1])
    assert all(x > 0 for x in odd)
    for bad in ([], [0, 0], [-1, 2], [float("nan"), 1]):
        with pytest.raises(ValueError):
            proportions(bad)


@settings(max_examples=40, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(1, 300), proportion_lists), min_size=1, max_size=4),
    cut=st.integers(0, 900),
    future=st.lists(st.tuples(st.integers(1, 300), proportion_lists), min_size=1, max_size=3),
)
def test_curriculum_is_continuous_and_a_changed_future_keeps_the_past(
    pieces: list[tuple[int, list[int]]], cut: int, future: list[tuple[int, list[int]]]
) -> None:
    k = len(pieces[0][1])
    pieces = [(s, (w + [1] * k)[:k]) for s, w in pieces]
    future = [(s, (w + [1] * k)[:k]) for s, w in future]

    def schedule(parts: list[tuple[int, list[int]]]) -> Schedule:
        starts = np.cumsum([0] + [s for s, _ in parts[:-1]]).tolist()
        return Schedule(
            [(int(s), w if any(w) else [1] * k) for s, (_, w) in zip(starts, parts, strict=True)]
        )

    old, new = schedule(pieces), schedule(future)
    spliced = old.continued(new, cut)
    length = 1000
    c_old, i_old = old.span(0, length)
    c_new, i_new = spliced.span(0, length)
    # the consumed part is the old schedule's, sample for sample
    assert (c_old[:cut] == c_new[:cut]).all() and (i_old[:cut] == i_new[:cut]).all()
    # and every component's stream is consumed in order: nothing repeated, nothing skipped
    for c, i in ((c_old, i_old), (c_new, i_new)):
        for comp in range(k):
            assert (i[c == comp] == np.arange(int((c == comp).sum()))).all()
    # from the cut on, the new schedule's proportions
    after = spliced.pieces[spliced._piece(cut)].a if cut < length else None
    assert after is None or list(after) == list(new.pieces[new._piece(cut)].a)
    # lookups at strided positions agree with the spans
    pos = np.arange(3, length, 7, dtype=np.int64)
    lc, li = spliced.lookup(pos, chunk=50)
    assert (lc == c_new[pos]).all() and (li == i_new[pos]).all()


def test_length_within_sizes() -> None:
    s = Schedule([(0, [1, 1]), (10, [1, 3])])
    n = s.length_within([100, 30])
    assert all(c <= m for c, m in zip(s.counts(n), [100, 30], strict=True))
    assert any(c > m for c, m in zip(s.counts(n + 1), [100, 30], strict=True))
    with pytest.raises(ValueError):
        Schedule([(5, [1, 1])])
    with pytest.raises(ValueError):
        Schedule([(0, [1, 1]), (0, [1, 2])])
