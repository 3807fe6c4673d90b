"""A seeded permutation of ``range(n)`` evaluated one index at a time, in O(1).

A keyed Feistel network is a bijection on ``[0, 4**k)``; "cycle walking" (apply it again
while the result is ``>= n``) turns it into a bijection on ``[0, n)``. So the position of
sample ``i`` in the shuffled order is computed from ``(key, i)`` alone: no table of ``n``
entries in memory or on disk, whatever the dataset size, and jumping to sample 10^12 costs
the same as jumping to sample 10. Keys come from ``numpy.random.SeedSequence``, whose
output is fixed across numpy versions and platforms.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash (arrays wrap on overflow)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """The bijection ``index -> shuffled index`` on ``[0, n)`` for one key (seed, epoch, ...)."""

    def __init__(self, n: int, key: tuple[int, ...]):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half_bits = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half_bits)) - 1)
        self.round_keys = np.random.SeedSequence(list(key)).generate_state(ROUNDS, np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half_bits, x & self.mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half_bits) | right

    def __call__(self, indices) -> np.ndarray:
        """Shuffled positions of ``indices`` (each in ``[0, n)``), as int64."""
        x = np.asarray(indices, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"permutation index out of range [0, {self.n}): min {x.min()}, max {x.max()}")
        x = x.astype(np.uint64)
        out = self._feistel(x)
        # Cycle walking: the domain is at most 4n, so on average < 4 passes, each vectorised.
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._feistel(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)
