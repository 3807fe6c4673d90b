"""The probe loss: the loss of one fixed batch, computed at save time and stored in the manifest.

After a resume, recomputing it on the loaded weights proves the weights are the saved ones
(bitwise at the same layout). The batch is the first PROBE_SEQUENCES samples of the global
sample order (global samples 0..3): independent of the world layout and the micro-batch size.
"""

from __future__ import annotations

from typing import Callable

import torch

from configs.constants import IGNORE_INDEX
from training.step import token_loss_sum

PROBE_SEQUENCES = 4


def make_probe(model: torch.nn.Module, data, device: torch.device, autocast=None) -> Callable[[], float]:
    """A function computing the probe loss; the batch is global samples [0, PROBE_SEQUENCES)."""
    from data.batching import SampleRange

    batch = data.dataset[SampleRange(0, PROBE_SEQUENCES)]
    return lambda: probe_loss(model, batch, device, autocast)


@torch.no_grad()
def probe_loss(model: torch.nn.Module, batch, device: torch.device, autocast=None) -> float:
    """Mean token loss of ``batch`` in eval mode (no dropout, no RNG drawn); every rank calls it."""
    inputs, targets = (t.to(device) for t in batch)
    was_training = model.training
    model.eval()
    try:
        if autocast is not None:
            with autocast():
                logits = model(inputs)
        else:
            logits = model(inputs)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return float(token_loss_sum(logits, targets)) / int((targets != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
