"""AdamW with decoupled weight decay on matrices only (not norms), fused where it can be."""

from __future__ import annotations

import torch
from torch import nn

from training.config import OPTIMIZER_IMPLEMENTATIONS


def _implementation_flags(choice: str, params) -> dict:
    on_cuda = all(p.device.type == "cuda" for p in params)
    if choice == "auto":
        choice = "fused" if on_cuda else "foreach"
    if choice == "fused":
        if not on_cuda:
            raise ValueError("optim.implementation=fused needs every parameter on CUDA; use auto or foreach")
        return {"fused": True}
    if choice == "foreach":
        return {"foreach": True}
    if choice == "for-loop":
        return {"foreach": False}
    raise ValueError(f"optim.implementation={choice!r}: choose one of {list(OPTIMIZER_IMPLEMENTATIONS)}")


DECAY_GROUP = 0  # param_groups[0]: matrices, decayed; [1]: norms and other vectors, not decayed


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    if optim_cfg.name != "adamw":
        raise ValueError(f"optim.name={optim_cfg.name!r}: only adamw is implemented")
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
        **_implementation_flags(optim_cfg.implementation, params),
    )
