"""What a dataloader worker does: turn one micro-batch's sample range into (inputs, targets).

Documents are packed back to back, each ended by EOS. With ``cross_document_loss`` the
targets are the plain shifted tokens (GPT-style packing: the token after an EOS, the next
document's first, is predicted from the previous document). Without it, the target at
every position whose input is EOS is set to IGNORE_INDEX (-100), so no loss term asks the
model to predict one document from another. In both cases attention still spans the whole
window (the model applies a plain causal mask), and RoPE positions do not restart.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from data.batching import SampleRange
from data.order import SampleOrder

IGNORE_INDEX = -100  # a target that carries no loss (PyTorch's cross-entropy default)


class MicroBatchDataset(torch.utils.data.Dataset):
    """Map-style dataset whose index is a SampleRange; deterministic, no RNG state."""

    def __init__(self, order: SampleOrder, eos_id: int, cross_document_loss: bool = True):
        self.order = order
        self.eos_id = eos_id
        self.cross_document_loss = cross_document_loss

    def __getitem__(self, samples: SampleRange) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.order.read(np.arange(samples.start, samples.start + samples.count)))
        inputs, targets = rows[:, :-1], rows[:, 1:].clone()
        if not self.cross_document_loss:
            targets[inputs == self.eos_id] = IGNORE_INDEX
        return inputs, targets

    def target_count(self, samples: SampleRange) -> int:
        """Target tokens (not ignored) in ``samples``, without building the batch: every position
        with cross-document loss; otherwise those whose input is not EOS (reads the tokens)."""
        seq_len = self.order.sources[0].seq_len
        if self.cross_document_loss:
            return samples.count * seq_len
        rows = self.order.read(np.arange(samples.start, samples.start + samples.count))
        return samples.count * seq_len - int((rows[:, :-1] == self.eos_id).sum())
