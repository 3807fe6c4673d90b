"""The global sample order (contract 1): which window is global sample g.

Global sample ``g`` is a pure function of (seed, g) and the data: the mixture schedule
names its source and its index ``k`` in that source's stream; the source's epoch is
``k // num_sequences`` and its window is a seeded permutation of the source's windows,
drawn again for every (seed, source, epoch). Each lookup is O(1) (data/permutation.py),
so no index is built or cached and resuming at sample 10^12 costs what sample 10 does.
The order never depends on the number of ranks: a rank only picks its slice of each
global batch (data/batching.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import List, Sequence, Tuple

import numpy as np

from data.mixture import MixtureSchedule
from data.permutation import Permutation
from data.token_source import TokenSource

ORDER_VERSION = 1  # bump when the order a (seed, data) gives changes


def dataset_fingerprint(sources: Sequence[TokenSource], quotas: Sequence[int]) -> str:
    """sha256 over every shard's content hash and the mixture quotas (not paths: data may move)."""
    desc = {"order_version": ORDER_VERSION,
            "sources": [{"shards": s.shard_hashes, "quota": q} for s, q in zip(sources, quotas)]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


class SampleOrder:
    def __init__(self, sources: Sequence[TokenSource], weights: Sequence[float], seed: int):
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} data sources but {len(weights)} weights")
        self.sources = list(sources)
        self.seed = seed
        self.schedule = MixtureSchedule(weights)
        self.fingerprint = dataset_fingerprint(self.sources, self.schedule.quotas)
        self.sequence_offsets = np.cumsum([0] + [s.num_sequences for s in self.sources])
        self._permutations: dict = {}

    def permutation(self, source: int, epoch: int) -> Permutation:
        key = (source, epoch)
        if key not in self._permutations:
            if len(self._permutations) > 64:
                self._permutations.clear()
            n = self.sources[source].num_sequences
            self._permutations[key] = Permutation(n, (self.seed, source, epoch))
        return self._permutations[key]

    def windows(self, g: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(source id, window id within the source) of global samples ``g``."""
        g = np.asarray(g, dtype=np.int64)
        if g.size and g.min() < 0:
            raise IndexError(f"global sample index must be >= 0, got {g.min()}")
        source, k = self.schedule.locate(g)
        window = np.empty_like(k)
        for s in np.unique(source):
            mine = source == s
            epoch, pos = np.divmod(k[mine], self.sources[s].num_sequences)
            out = np.empty_like(pos)
            for e in np.unique(epoch):
                at = epoch == e
                out[at] = self.permutation(int(s), int(e))(pos[at])
            window[mine] = out
        return source, window

    def sequence_ids(self, g: np.ndarray) -> np.ndarray:
        """One id per global sample over all sources' windows: what a test compares."""
        source, window = self.windows(g)
        return self.sequence_offsets[source] + window

    def read(self, g: np.ndarray) -> np.ndarray:
        """Token rows (int64, seq_len + 1 each) of global samples ``g``."""
        source, window = self.windows(g)
        rows = np.empty((len(window), self.sources[0].seq_len + 1), dtype=np.int64)
        for s in np.unique(source):
            mine = source == s
            rows[mine] = self.sources[s].read(window[mine])
        return rows

    def epochs(self, samples_consumed: int) -> List[int]:
        """The epoch each source's next sample comes from, after ``samples_consumed``."""
        drawn = self.schedule.drawn(samples_consumed)
        return [d // s.num_sequences for d, s in zip(drawn, self.sources)]
