"""A weighted mixture of sources with a deterministic, O(1)-addressable interleaving.

Weights become integer quotas per block of ``block_size`` samples: each weight is taken as
its nearest fraction with a denominator up to 1000 (0.7/0.3 -> 7/3, exact; 0.123457 ->
10/81), and when that makes the block longer than 10000 samples, the quotas are the
nearest that sum to 10000 (no source with a positive weight is ever dropped). Within
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
    """Smallest integer quotas in the ratio of ``weights`` (or the nearest summing to MAX_BLOCK)."""
    if not weights:
        raise ValueError("a data mixture needs at least one source")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"data mixture weights must be positive numbers, got {list(weights)}")
    fractions = [Fraction(w).limit_denominator(1000) for w in weights]
    if all(f > 0 for f in fractions):
        scale = math.lcm(*(f.denominator for f in fractions))
        quotas = [int(f * scale) for f in fractions]
        g = math.gcd(*quotas)
        quotas = [q // g for q in quotas]
        if sum(quotas) <= MAX_BLOCK:
            return quotas
    if len(weights) > MAX_BLOCK:
        raise ValueError(f"{len(weights)} data sources: at most {MAX_BLOCK} can be mixed")
    total = sum(weights)  # nearest quotas summing to MAX_BLOCK; every source keeps a slot
    exact = [w / total * MAX_BLOCK for w in weights]
    quotas = [max(1, int(e)) for e in exact]
    while sum(quotas) < MAX_BLOCK:
        i = max(range(len(quotas)), key=lambda j: exact[j] - quotas[j])
        quotas[i] += 1
    while sum(quotas) > MAX_BLOCK:
        i = max((j for j in range(len(quotas)) if quotas[j] > 1), key=lambda j: quotas[j] - exact[j])
        quotas[i] -= 1
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
