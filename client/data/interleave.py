"""Which component of a mixture stands at each position: computed, never stored.

A mixture of components with integer proportions ``a_i`` (``D = sum a_i``)
places component ``i``'s ``m``-th sample at the ideal time
``(m + 1/2) / a_i`` and orders all samples of all components by that time
(ties: the lower component first). This is the divisor method of
apportionment (Sainte-Laguë) read as a sequence, or stride scheduling. Its
properties are what a training mix needs:

* **From the position alone.** The position of component ``i``'s sample
  ``m`` is ``m`` plus, for every other component ``j``, how many of its
  ideal times come earlier: one integer division each, O(#components), no
  table (`Interleave.rank`). The inverse (how many samples of each
  component the first ``p`` positions hold) is a short search over that.
* **Exact proportions.** After any ``p`` positions, component ``i`` has
  ``p * a_i / D + e`` samples with ``|e| <= 1/2 + (k - 2) * w_i / 2`` (``k``
  components of nonzero weight, ``w_i = a_i / D``): every ideal time before
  the cut is in, those after are out, and each component is off its ideal
  count by at most 1/2. So in every window of ``N`` consecutive positions a
  component's count is within ``1 + (k - 2) * w_i`` of ``N * w_i``: within
  one for two components. No order can promise one for three or more
  components and every weight: for 0.45/0.35/0.2 an exhaustive search finds
  no order of even 11 positions in which every window is within one
  (`tests/data/test_interleave.py`), while for 0.5/0.3/0.2 this one is.
* **Monotone.** Each position adds exactly one sample of one component, so a
  component's samples are consumed in its own order, with no gap and no
  repeat.

A `Schedule` is a piecewise mixture: proportions that change at given global
positions (a curriculum). Each piece continues every component's count where
the previous piece left it, so a schedule changed for the future (a new
piece from the current position on) leaves everything before that position
as it was and never repeats or skips a component's sample.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]

RESOLUTION = 1 << 20  # proportions that are not small fractions are rounded to this
EXACT_DENOMINATOR = 1 << 16  # weights are read as fractions with denominators up to this
INT64_SAFE = 1 << 62


def proportions(weights: Sequence[float | int | Fraction]) -> tuple[int, ...]:
    """Integer proportions for *weights*: exact for weights that are fractions
    with small denominators (0.5, 0.3, 0.2 -> 5, 3, 2), else rounded to
    1/2**20 of the total; a nonzero weight never becomes zero."""
    if not weights:
        raise ValueError("a mixture needs at least one component")
    fracs = []
    for w in weights:
        if isinstance(w, float) and not math.isfinite(w):
            raise ValueError(f"weights must be finite, not {w}")
        f = Fraction(w).limit_denominator(EXACT_DENOMINATOR)
        if f < 0:
            raise ValueError(f"weights must be >= 0, not {w}")
        fracs.append(f)
    total = sum(fracs)
    if total == 0:
        raise ValueError("at least one weight must be > 0")
    shares = [f / total for f in fracs]
    den = math.lcm(*(s.denominator for s in shares))
    if den <= RESOLUTION:
        ints = [int(s * den) for s in shares]
    else:
        ints = [max(1, round(s * RESOLUTION)) if s else 0 for s in shares]
    g = math.gcd(*ints)
    return tuple(a // g for a in ints)


class Interleave:
    """The order of one mixture piece with integer proportions *a*."""

    def __init__(self, a: Sequence[int]) -> None:
        self.a = tuple(int(x) for x in a)
        if any(x < 0 for x in self.a) or not any(self.a):
            raise ValueError(f"proportions must be >= 0 and not all 0: {self.a}")
        self.total = sum(self.a)
        self.active = [i for i, x in enumerate(self.a) if x]

    def rank(self, i: int, m: int) -> int:
        """The position of component *i*'s sample *m*."""
        ai = self.a[i]
        r = m
        for j in self.active:
            if j != i:
                q = (2 * m + 1) * self.a[j]
                c = q // ai if j < i else (q - 1) // ai
                r += (c + 1) // 2
        return r

    def ranks(self, i: int, m: IntArray) -> IntArray:
        """`rank` of many samples of component *i* (vectorized)."""
        ai = self.a[i]
        big = m.size and (2 * int(m.max()) + 1) * max(self.a) >= INT64_SAFE
        mm: Any = m.astype(object) if big else m  # Python ints past int64's range
        r = mm.copy()
        for j in self.active:
            if j != i:
                q = (2 * mm + 1) * self.a[j]
                c = q // ai if j < i else (q - 1) // ai
                r = r + (c + 1) // 2
        return np.asarray(r, dtype=np.int64)

    def counts(self, p: int) -> list[int]:
        """How many samples of each component the first *p* positions hold."""
        out = [0] * len(self.a)
        for i in self.active:
            out[i] = self._first_at_or_after(i, p)
        return out

    def _first_at_or_after(self, i: int, p: int) -> int:
        """The smallest m with rank(i, m) >= p (= component i's count before p)."""
        slack = 2 * len(self.active) + 2
        guess = p * self.a[i] // self.total
        lo, hi = max(0, guess - slack), guess + slack
        while lo > 0 and self.rank(i, lo) >= p:
            lo = max(0, lo - 2 * (guess - lo + 1))
        while self.rank(i, hi) < p:
            hi += hi - lo + 1
        while lo < hi:  # rank(i, lo - 1) < p (or lo == 0), rank(i, hi) >= p
            mid = (lo + hi) // 2
            if self.rank(i, mid) >= p:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def span(self, p: int, count: int) -> tuple[IntArray, IntArray]:
        """(component, index in the component) of positions ``[p, p + count)``."""
        comp = np.full(count, -1, dtype=np.int64)
        index = np.zeros(count, dtype=np.int64)
        before, after = self.counts(p), self.counts(p + count)
        for i in self.active:
            m = np.arange(before[i], after[i], dtype=np.int64)
            at = self.ranks(i, m) - p
            comp[at] = i
            index[at] = m
        return comp, index


class Schedule:
    """Piecewise proportions: ``pieces[k] = (start, proportions)``, from global
    position ``start`` until the next piece's start; the first starts at 0."""

    def __init__(self, pieces: Sequence[tuple[int, Sequence[float | int | Fraction]]]) -> None:
        if not pieces:
            raise ValueError("a schedule needs at least one piece")
        starts = [int(s) for s, _ in pieces]
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"schedule starts must begin at 0 and increase: {starts}")
        width = {len(w) for _, w in pieces}
        if len(width) != 1:
            raise ValueError("every piece of a schedule needs one weight per component")
        self.starts: list[int] = []
        self.pieces: list[Interleave] = []
        for start, (_, w) in zip(starts, pieces, strict=True):
            piece = Interleave(proportions(w))
            if not self.pieces or piece.a != self.pieces[-1].a:  # the same again: one piece
                self.starts.append(start)
                self.pieces.append(piece)
        self.components = width.pop()
        # each component's count at the start of each piece
        self.base: list[list[int]] = [[0] * self.components]
        for k in range(1, len(self.starts)):
            got = self.pieces[k - 1].counts(self.starts[k] - self.starts[k - 1])
            self.base.append([b + g for b, g in zip(self.base[-1], got, strict=True)])

    @classmethod
    def constant(cls, weights: Sequence[float | int | Fraction]) -> Schedule:
        return cls([(0, weights)])

    def as_list(self) -> list[list[object]]:
        """The schedule as saved in a state (integer proportions)."""
        return [[s, list(p.a)] for s, p in zip(self.starts, self.pieces, strict=True)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.as_list() == other.as_list()

    def __hash__(self) -> int:
        return hash(repr(self.as_list()))

    def _piece(self, p: int) -> int:
        return int(np.searchsorted(self.starts, p, side="right")) - 1

    def counts(self, p: int) -> list[int]:
        """Each component's samples among the first *p* positions."""
        k = self._piece(p)
        got = self.pieces[k].counts(p - self.starts[k])
        return [b + g for b, g in zip(self.base[k], got, strict=True)]

    def span(self, p: int, count: int) -> tuple[IntArray, IntArray]:
        """(component, index in the component's stream) of ``[p, p + count)``."""
        comps, indices = [], []
        end = p + count
        while p < end:
            k = self._piece(p)
            stop = end if k + 1 == len(self.starts) else min(end, self.starts[k + 1])
            c, i = self.pieces[k].span(p - self.starts[k], stop - p)
            base = np.asarray(self.base[k], dtype=np.int64)
            comps.append(c)
            indices.append(i + base[c])
            p = stop
        if not comps:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(comps), np.concatenate(indices)

    def lookup(self, positions: IntArray, chunk: int = 1 << 16) -> tuple[IntArray, IntArray]:
        """`span` at arbitrary sorted *positions* (a rank's strided ones),
        computing contiguous runs of at most *chunk* positions."""
        comp = np.empty(positions.size, dtype=np.int64)
        index = np.empty(positions.size, dtype=np.int64)
        k = 0
        while k < positions.size:
            lo = int(positions[k])
            j = int(np.searchsorted(positions, lo + chunk, side="left"))
            c, i = self.span(lo, int(positions[j - 1]) - lo + 1)
            comp[k:j] = c[positions[k:j] - lo]
            index[k:j] = i[positions[k:j] - lo]
            k = j
        return comp, index

    def length_within(self, sizes: Sequence[int]) -> int:
        """The longest prefix in which no component needs more than its
        *sizes* samples (where a mixture that stops at the first exhausted
        component ends)."""

        def fits(p: int) -> bool:
            return all(c <= n for c, n in zip(self.counts(p), sizes, strict=True))

        lo = 0
        hi = max(1, self.starts[-1] + sum(sizes) + 1)
        while fits(hi):  # the last piece draws from some component: ends
            hi *= 2
        while lo + 1 < hi:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def continued(self, future: Schedule, position: int) -> Schedule:
        """This schedule up to *position* and *future* from there on: what a run
        consumed stays consumed, the rest follows the new schedule."""
        if future.components != self.components:
            raise ValueError("the new schedule has another number of components")
        pieces: list[tuple[int, Sequence[int]]] = [
            (s, p.a) for s, p in zip(self.starts, self.pieces, strict=True) if s < position
        ]
        # (the same proportions as the piece running at *position* merge
        # into it, `Schedule` keeps one piece: the run goes on undisturbed)
        pieces.append((position, future.pieces[future._piece(position)].a))
        pieces += [
            (s, p.a) for s, p in zip(future.starts, future.pieces, strict=True) if s > position
        ]
        return Schedule([(s, list(a)) for s, a in pieces])
