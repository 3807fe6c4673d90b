"""AdamW with decoupled weight decay on matrices only (not norms), fused where it can be."""

from __future__ import annotations

import torch
from torch import nn

DECAY_GROUP = 0  # param_groups[0]: matrices, decayed; [1]: norms and other vectors, not decayed


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    """``optim_cfg``: optim.* (its name is adamw: the one choice its key has)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim_cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    on_cuda = all(p.device.type == "cuda" for p in params)
    choice = optim_cfg.implementation
    if choice == "fused" and not on_cuda:
        raise ValueError("optim.implementation=fused needs every parameter on CUDA; use auto or foreach")
    if choice == "auto":
        choice = "fused" if on_cuda else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[choice]
    return torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                             **flags)
