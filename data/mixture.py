"""A weighted mixture of sources with a deterministic, O(1)-addressable interleaving.

Weights become integer quotas per block of ``block_size`` samples (exact when the weights
are ratios of small numbers, e.g. 0.7/0.3 -> 7/3; otherwise rounded to 1/10000). Within
every block the slots are assigned by smooth weighted round robin, so sources are spread
evenly rather than in runs. Global sample ``g`` is slot ``g % block_size`` of block
``g // block_size``; which source it comes from, and how many samples that source gave
before it, follow in O(1) from a table of ``block_size`` entries.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Sequence, Tuple

import numpy as np

MAX_BLOCK = 10_000


def weight_quotas(weights: Sequence[float]) -> List[int]:
    """Smallest integer quotas in the ratio of ``weights`` (or the nearest at MAX_BLOCK)."""
    if not weights:
        raise ValueError("a data mixture needs at least one source")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"data mixture weights must be positive numbers, got {list(weights)}")
    fractions = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    quotas = [int(f * scale) for f in fractions]
    g = math.gcd(*quotas)
    quotas = [q // g for q in quotas]
    if sum(quotas) <= MAX_BLOCK:
        return quotas
    total = sum(weights)  # largest remainder at MAX_BLOCK, every source keeps a slot
    exact = [w / total * MAX_BLOCK for w in weights]
    quotas = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: quotas[i] - exact[i])
    for i in by_remainder[: MAX_BLOCK - sum(quotas)]:
        quotas[i] += 1
    return quotas


class MixtureSchedule:
    def __init__(self, weights: Sequence[float]):
        self.quotas = weight_quotas(weights)
        self.block_size = sum(self.quotas)
        credit = np.zeros(len(self.quotas), dtype=np.int64)
        slots = np.empty(self.block_size, dtype=np.int64)
        for slot in range(self.block_size):  # smooth weighted round robin (ties: lower index)
            credit += self.quotas
            slots[slot] = int(np.argmax(credit))
            credit[slots[slot]] -= self.block_size
        self.slot_source = slots
        # drawn_before[slot, s]: samples source s gave in this block before ``slot``.
        onehot = np.eye(len(self.quotas), dtype=np.int64)[slots]
        self.drawn_before = np.vstack([np.zeros((1, len(self.quotas)), np.int64), np.cumsum(onehot, axis=0)])

    def locate(self, g: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(source id, index within that source's stream) of global samples ``g``."""
        block, slot = np.divmod(np.asarray(g, dtype=np.int64), self.block_size)
        source = self.slot_source[slot]
        quota = np.asarray(self.quotas, dtype=np.int64)[source]
        return source, block * quota + self.drawn_before[slot, source]

    def drawn(self, samples: int) -> List[int]:
        """How many samples each source has given in global samples ``[0, samples)``."""
        block, slot = divmod(samples, self.block_size)
        return [block * q + int(self.drawn_before[slot, s]) for s, q in enumerate(self.quotas)]
