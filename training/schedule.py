"""Learning rate: linear warmup to lr_max, then cosine decay to lr_min at the last step.

For optimizer step s (0-based) of S total steps with W warmup steps:

    s <  W:  lr(s) = lr_max * (s + 1) / W
    s >= W:  lr(s) = lr_min + (lr_max - lr_min) * (1 + cos(pi * (s - W) / max(1, S - W))) / 2

so the first step already trains (lr_max / W), warmup ends at lr_max, and the last step
(s = S - 1) sits just above lr_min. ``schedule=constant`` keeps lr_max after warmup.

On resume the config wins (``apply_config``): lr_max, lr_min, W, S and the schedule are this
run's, evaluated at the restored step, so extending ``training.steps`` or changing ``optim.lr``
continues on the new curve from where the checkpoint stopped.
"""

from __future__ import annotations

import math

import torch

from training.optimizer import DECAY_GROUP


def lr_at(step: int, *, lr_max: float, lr_min: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine") -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return lr_max * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr_max
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr_min + (lr_max - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(optim_cfg, total_steps: int, step: int) -> float:
    """LambdaLR's factor at 0-based ``step``: this run's schedule over its peak LR (``optim_cfg``: optim.*)."""
    return lr_at(step, lr_max=optim_cfg.lr, lr_min=optim_cfg.lr_min, warmup_steps=optim_cfg.warmup_steps,
                 total_steps=total_steps, schedule=optim_cfg.schedule) / optim_cfg.lr


def schedule_lr(optim_cfg, total_steps: int, step: int) -> float:
    """The LR the scheduler sets for 0-based ``step``, computed as LambdaLR does."""
    return optim_cfg.lr * lr_factor(optim_cfg, total_steps, step)


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch) is the step count: trivially checkpointable."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(optim_cfg, total_steps, step))


def apply_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, optim_cfg) -> None:
    """After a checkpoint restored the optimizer and the scheduler, make this run's config win (the module
    docstring): the scheduler keeps its restored step (``last_epoch``) and its lambdas, already this run's;
    peak LR, weight decay, betas and eps come from ``optim_cfg``, and every group's LR is the schedule's at
    that step, computed as LambdaLR does (bitwise the checkpoint's LR when nothing changed)."""
    step = scheduler.last_epoch
    scheduler.base_lrs = [float(optim_cfg.lr) for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(step)
        group["betas"] = (optim_cfg.beta1, optim_cfg.beta2)
        group["eps"] = optim_cfg.eps
    optimizer.param_groups[DECAY_GROUP]["weight_decay"] = optim_cfg.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
