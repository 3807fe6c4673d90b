"""Exponential moving average of the parameters (``training.ema_decay``; 0 turns it off).

The shadow copies have the same type and sharding as the parameters (DTensors under
FSDP/TP), so the checkpoint stores them sharded and reshards them like the model.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        """``decay``: training.ema_decay, in (0, 1) (0: no EMA is built)."""
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """shadow <- decay * shadow + (1 - decay) * param, after every optimizer step."""
        names = list(self.shadow)
        torch._foreach_lerp_([self.shadow[n] for n in names], [self.params[n].detach() for n in names],
                             1.0 - self.decay)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.shadow

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if tensor is not self.shadow[name]:
                self.shadow[name].copy_(tensor)
