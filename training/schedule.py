"""Learning rate: linear warmup to lr_max, then cosine decay to lr_min at the last step.

For optimizer step s (0-based) of S total steps with W warmup steps:

    s <  W:  lr(s) = lr_max * (s + 1) / W
    s >= W:  lr(s) = lr_min + (lr_max - lr_min) * (1 + cos(pi * (s - W) / max(1, S - W))) / 2

so the first step already trains (lr_max / W), warmup ends at lr_max, and the last step
(s = S - 1) sits just above lr_min. ``schedule=constant`` keeps lr_max after warmup.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr_max: float, lr_min: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine") -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return lr_max * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr_max
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr_min + (lr_max - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch) is the step count: trivially checkpointable."""
    lr_max = optim_cfg.lr

    def factor(step: int) -> float:
        return lr_at(step, lr_max=lr_max, lr_min=optim_cfg.lr_min, warmup_steps=optim_cfg.warmup_steps,
                     total_steps=total_steps, schedule=optim_cfg.schedule) / lr_max

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
