"""The keyed bijection: a permutation for every size, keyed by seed and epoch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shufflefs.client.data.permutation import KeyedPermutation, derive_keys

PRIMES = [2, 3, 5, 7, 11, 13, 31, 127, 257, 65537, 1009, 7919, 104729]


def assert_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    perm = KeyedPermutation(n, seed, epoch)
    out = perm(np.arange(n))
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))
    return out


@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(st.integers(1, 70), st.integers(1, 5000), st.sampled_from(PRIMES)),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 10_000),
)
def test_is_a_permutation_for_any_size(n: int, seed: int, epoch: int) -> None:
    out = assert_permutation(n, seed, epoch)
    perm = KeyedPermutation(n, seed, epoch)
    # the scalar path and the inverse agree with the vectorized one
    for p in np.random.default_rng(seed % 2**32).integers(0, n, size=min(n, 20)).tolist():
        assert perm.index(p) == out[p]
        assert perm.position(int(out[p])) == p


def test_size_one_and_zero() -> None:
    assert KeyedPermutation(1, 5, 7)(np.arange(1)).tolist() == [0]
    assert KeyedPermutation(1, 5, 7).index(0) == 0
    assert KeyedPermutation(0, 5, 7)(np.arange(0)).tolist() == []
    with pytest.raises(IndexError):
        KeyedPermutation(0, 5, 7).index(0)


def test_out_of_range_positions_are_refused() -> None:
    perm = KeyedPermutation(10, 0, 0)
    with pytest.raises(IndexError):
        perm(np.array([3, 10]))
    with pytest.raises(IndexError):
        perm.index(-1)
    with pytest.raises(ValueError):
        KeyedPermutation(2**62 + 1, 0, 0)


def test_huge_sizes_need_no_memory() -> None:
    for n in (2**40 + 7, 2**61 - 1, 2**62):
        perm = KeyedPermutation(n, 11, 3)
        positions = np.random.default_rng(0).integers(0, n, size=2000, dtype=np.int64)
        out = perm(positions)
        assert ((out >= 0) & (out < n)).all()
        assert len(set(out.tolist())) == len(set(positions.tolist()))
        for p, i in zip(positions[:50].tolist(), out[:50].tolist(), strict=True):
            assert perm.index(p) == i
            assert perm.position(i) == p
        assert perm.index(n - 1) < n


def test_vectorized_keeps_shape() -> None:
    perm = KeyedPermutation(1000, 1, 2)
    grid = np.arange(12).reshape(3, 4)
    out = perm(grid)
    assert out.shape == (3, 4)
    assert out.ravel().tolist() == [perm.index(p) for p in range(12)]
    assert perm(5).shape == ()


def test_seeds_and_epochs_give_different_orders() -> None:
    n = 1000
    orders = {
        (seed, epoch): assert_permutation(n, seed, epoch).tobytes()
        for seed in range(4)
        for epoch in range(4)
    }
    assert len(set(orders.values())) == len(orders)
    # and the same key gives the same order again, in a fresh object
    assert assert_permutation(n, 2, 3).tobytes() == orders[(2, 3)]
    assert derive_keys(0, 1, n) != derive_keys(1, 0, n)


@pytest.mark.parametrize("n", [997, 4096, 100_003])
def test_looks_shuffled(n: int) -> None:
    """Not a statistical proof, but a wrong round function (identity, a
    plain rotation, a key that is ignored) fails every one of these."""
    out = assert_permutation(n, 0, 0)
    positions = np.arange(n)
    assert np.mean(out == positions) < 0.01  # few fixed points
    rho = np.corrcoef(positions, out)[0, 1]
    assert abs(rho) < 0.05
    # consecutive positions land far apart
    gaps = np.abs(np.diff(out))
    assert np.median(gaps) > n / 8
    other = KeyedPermutation(n, 0, 1)(positions)
    assert abs(np.corrcoef(out, other)[0, 1]) < 0.05
