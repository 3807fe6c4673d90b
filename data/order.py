"""The global sample order (contract 1): which sequence is global sample g.

The token stream is cut into ``num_sequences = (num_tokens - 1) // seq_len`` windows of
``seq_len + 1`` tokens (inputs plus the shifted targets; neighbours share one token).
Epoch e visits every window once, in the order of a permutation drawn from
(seed, e). Global sample g lives in epoch g // num_sequences. The order is independent of
the number of ranks; a rank only picks its slice of each global batch.
"""

from __future__ import annotations

import numpy as np


class GlobalOrder:
    def __init__(self, num_tokens: int, seq_len: int, seed: int):
        self.seq_len = seq_len
        self.seed = seed
        self.num_sequences = (num_tokens - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"the dataset has {num_tokens} tokens, fewer than one sequence of "
                f"seq_len + 1 = {seq_len + 1}; use more data or a shorter training.seq_len"
            )
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.num_sequences)
            self._epoch = epoch
        return self._perm

    def sequence_ids(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples [start, start + count), across epoch boundaries."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            g = start + filled
            epoch, pos = divmod(g, self.num_sequences)
            take = min(count - filled, self.num_sequences - pos)
            out[filled:filled + take] = self.permutation(epoch)[pos:pos + take]
            filled += take
        return out
