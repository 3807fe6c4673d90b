"""The training, optim and eval sections checked at start-up (torch-free; trainer/checks.py gathers them)."""

from __future__ import annotations

import math

from configs.checks import Problems
from configs.constants import OPTIMIZER_IMPLEMENTATIONS, OPTIMIZERS, PRECISIONS, SCHEDULES


def config_problems(cfg, problems: Problems) -> None:
    t, o, e = cfg.training, cfg.optim, cfg.eval
    problems.at_least("training.steps", t.steps, 1)
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        problems.append(f"optim.warmup_steps={o.warmup_steps} is longer than the run (training.steps={t.steps}); "
                        f"use 0 to {t.steps} (typically 1-5% of the steps)")
    problems.at_least("training.seq_len", t.seq_len, 1)
    if t.seq_len > cfg.model.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} is above the model's maximum model.max_seq_len="
                        f"{cfg.model.max_seq_len}; lower training.seq_len or raise model.max_seq_len")
    problems.choice("training.mixed_precision", t.mixed_precision, PRECISIONS)
    problems.at_least("training.grad_clip", t.grad_clip, 0, "0 disables clipping")
    if not 0 <= t.ema_decay < 1:
        problems.append(f"training.ema_decay={t.ema_decay} must be in [0, 1) (0 disables EMA)")
    problems.choice("optim.name", o.name, OPTIMIZERS)
    problems.choice("optim.implementation", o.implementation, OPTIMIZER_IMPLEMENTATIONS)
    problems.choice("optim.schedule", o.schedule, SCHEDULES)
    problems.positive("optim.lr", o.lr)
    if not 0 <= o.lr_min <= o.lr:
        problems.append(f"optim.lr_min={o.lr_min} must be between 0 and optim.lr={o.lr}")
    problems.at_least("optim.weight_decay", o.weight_decay, 0)
    if math.isfinite(o.lr * o.weight_decay) and o.lr * o.weight_decay >= 1:
        problems.append(f"optim.weight_decay={o.weight_decay} x optim.lr={o.lr} must be < 1: AdamW scales every "
                        "weight by 1 - lr x weight_decay each step (typical: 0.1 x 3e-4)")
    for key in ("beta1", "beta2"):
        if not 0 <= o[key] < 1:
            problems.append(f"optim.{key}={o[key]} must be in [0, 1)")
    problems.positive("optim.eps", o.eps)
    problems.at_least("eval.interval", e.interval, 0, "0 turns evaluation off")
    problems.at_least("eval.batches", e.batches, 1)
