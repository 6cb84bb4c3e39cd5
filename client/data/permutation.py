"""A keyed bijection over ``[0, n)``: the shuffle, computed instead of stored.

Training wants a different random order of its samples every epoch, the same
order again when a run is replayed, and any position of it on demand (to
resume, to name the samples of a step afterwards, to read ahead). A stored
permutation of a billion windows costs 8 GB per epoch; this costs two dozen
integers whatever ``n`` is.

The construction is a balanced Feistel network over the smallest even number
of bits that covers ``n`` (a domain of at most ``4n`` values), with cycle
walking to stay inside ``[0, n)``: apply the network to ``x``; while the
result is ``>= n``, apply it again. A Feistel network is a permutation of its
domain whatever its round function, and cycle walking restricts a permutation
of a domain to a permutation of any subset of it, so ``perm`` is a bijection
of ``[0, n)`` by construction; the round function only decides how random it
looks. Each of the eight rounds mixes one half with the SplitMix64 finalizer
under a 64-bit round key; the keys come from BLAKE2b of (seed, epoch, n), so
every epoch and every seed gets an unrelated permutation. Because the domain is
under ``4n``, a position needs fewer than four walks on average.

Everything is vectorized with numpy (uint64 arithmetic wraps modulo 2**64,
which is what the mixing wants), so the window indices of a whole batch are
computed in one pass; `index` is the same function on one Python int.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import numpy.typing as npt

ROUNDS = 8
MASK64 = (1 << 64) - 1
MAX_ITEMS = 1 << 62  # positions and indices must fit int64 comfortably
SCALAR_WALKS = 32  # cycle walks of this few items are finished one by one
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_KEY_CONTEXT = b"shufflefs.permutation.v1"

IntArray = npt.NDArray[np.int64]


def derive_keys(seed: int, epoch: int, n: int, rounds: int = ROUNDS) -> list[int]:
    """Round keys for (seed, epoch, n): a real hash, so neighbouring seeds or
    epochs give unrelated permutations (a plain counter would not)."""
    digest = hashlib.blake2b(
        struct.pack("<QQQ", seed & MASK64, epoch & MASK64, n & MASK64),
        digest_size=8 * rounds,
        person=b"sfs-perm",
        key=_KEY_CONTEXT,
    ).digest()
    return list(struct.unpack(f"<{rounds}Q", digest))


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def _mix_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """``perm(i)`` for ``i`` in ``[0, n)``: a pseudo-random bijection keyed by
    (seed, epoch). Memory is O(1) in ``n``; one position costs O(1) expected."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if not 0 <= n <= MAX_ITEMS:
            raise ValueError(f"permutation size must be in [0, 2**62], not {n}")
        self.n = n
        self.seed = seed
        self.epoch = epoch
        bits = max(2, (n - 1).bit_length()) if n > 1 else 2
        bits += bits & 1  # balanced halves
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = derive_keys(seed, epoch, n)

    def __len__(self) -> int:
        return self.n

    # ---- one position ---------------------------------------------------

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def _feistel_inverse(self, y: int) -> int:
        left, right = y >> self.half, y & self.mask
        for k in reversed(self.keys):
            left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << self.half) | right

    def index(self, position: int) -> int:
        """The item at *position* of the shuffled order."""
        self._check(position)
        x = self._feistel(position)
        while x >= self.n:
            x = self._feistel(x)
        return x

    def position(self, index: int) -> int:
        """Where item *index* appears in the shuffled order (the inverse)."""
        self._check(index)
        x = self._feistel_inverse(index)
        while x >= self.n:
            x = self._feistel_inverse(x)
        return x

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"position {i} outside [0, {self.n})")

    # ---- many positions at once -----------------------------------------

    def _feistel_array(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        half = np.uint64(self.half)
        mask = np.uint64(self.mask)
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix_array(right ^ np.uint64(k)) & mask)
        out: npt.NDArray[np.uint64] = (left << half) | right
        return out

    def __call__(self, positions: npt.ArrayLike) -> IntArray:
        """The items at *positions* (any integer array), vectorized."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        x = self._feistel_array(pos.reshape(-1).astype(np.uint64))
        limit = np.uint64(self.n)
        outside = np.flatnonzero(x >= limit)
        while outside.size > SCALAR_WALKS:
            walked = self._feistel_array(x[outside])
            x[outside] = walked
            outside = outside[walked >= limit]
        for k in outside.tolist():  # the last few: a numpy pass costs as much as one item
            v = int(x[k])
            while v >= self.n:
                v = self._feistel(v)
            x[k] = v
        return x.astype(np.int64).reshape(pos.shape)
