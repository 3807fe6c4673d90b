"""AdamW with decoupled weight decay on matrices only (not norms), fused where it can be."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype

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


def init_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the state an optimizer's first step would, without the step; True when done here.

    A load needs the state's tensors to exist (DCP reads into them). DCP makes them with a zero-lr step
    (``_init_optim_state``), which on DTensor shards costs a sharding propagation per foreach op: most of a
    resume's CPU at a few million parameters. For ``torch.optim.AdamW`` exactly, this builds what that step
    leaves, tensor for tensor: ``step`` 1.0 (where and in the dtype AdamW keeps it), ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) zeros shaped like each parameter (a DTensor like
    its DTensor). Anything else (another optimizer, a subclass, state already there, a gradient present:
    DCP then initialises nothing either) is left to DCP's way, so its result is unchanged."""
    if type(optimizer) is not torch.optim.AdamW or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(p.grad is not None for g in groups for p in g["params"]):
        return False
    for group in groups:
        on_device = group["capturable"] or group["fused"]
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if on_device:
                step = torch.ones((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
            else:
                step = torch.tensor(1.0, dtype=_get_scalar_dtype(), device="cpu")
            state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
    return True
