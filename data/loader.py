"""Per-rank micro-batches of a step, read straight from the memory-mapped token file.

Rank r of dp takes the contiguous slice [r * G/dp, (r+1) * G/dp) of global batch s and
cuts it into grad_accum_steps micro-batches of micro_batch_size, in order. Over all ranks
and micro-steps that is exactly the global batch, whatever dp is.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from data.batching import BatchPlan
from data.order import GlobalOrder
from data.token_file import TokenFile


class StepBatches:
    def __init__(self, token_file: TokenFile, seq_len: int, seed: int, plan: BatchPlan, dp_rank: int):
        self.tokens = token_file.tokens
        self.seq_len = seq_len
        self.order = GlobalOrder(len(token_file), seq_len, seed)
        self.plan = plan
        self.dp_rank = dp_rank

    def sample_ids(self, step: int) -> np.ndarray:
        """Global sample indices this rank reads in ``step``, in micro-batch order."""
        per_rank = self.plan.per_rank_batch_size
        start = step * self.plan.global_batch_size + self.dp_rank * per_rank
        return np.arange(start, start + per_rank)

    def micro_batches(self, step: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        samples = self.sample_ids(step)
        windows = self.order.sequence_ids(int(samples[0]), len(samples))
        L = self.seq_len
        rows = np.stack([self.tokens[w * L: w * L + L + 1] for w in windows]).astype(np.int64)
        rows = torch.from_numpy(rows)
        m = self.plan.micro_batch_size
        return [(rows[i:i + m, :-1], rows[i:i + m, 1:]) for i in range(0, len(rows), m)]
