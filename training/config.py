"""The training, optim and eval sections: the step, the optimizer and its schedule, validation (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from configs.keys import AT_LEAST_1, FRACTION, NON_NEGATIVE, POSITIVE, SIZE, Bound, key

PRECISIONS = ("fp32", "bf16", "fp16")  # autocast dtype; parameters and optimizer state stay fp32
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


@dataclass
class TrainingConfig:
    steps: int = key(100, "optimizer steps of the run", AT_LEAST_1)
    global_batch_size: int = key(8, "sequences per optimizer step, over all ranks (fixed for the run)", SIZE)
    micro_batch_size: int = key(8, "sequences per forward pass on one rank (fixed by memory)", SIZE)
    seq_len: int = key(128, "tokens per sequence", AT_LEAST_1)
    mixed_precision: str = key("fp32", "fp32 | bf16 (autocast) | fp16 (autocast + GradScaler)", choices=PRECISIONS)
    grad_clip: float = key(1.0, "the largest global gradient norm; 0 disables clipping", NON_NEGATIVE)
    ema_decay: float = key(0.0, "EMA of the weights (training/ema.py), checkpointed; 0 disables", FRACTION)
    gc_interval: int = key(50, "steps between Python garbage collections (generation 1), at the same steps on "
                           "every rank; automatic collection is off; 0: Python's own schedule", NON_NEGATIVE)


@dataclass
class EvalConfig:
    """Validation loss (training/evaluate.py) on data.validation; off while data.validation=none."""

    interval: int = key(100, "steps between evaluations (also after the last step and before every save); 0: off",
                        NON_NEGATIVE)
    batches: int = key(8, "fixed validation batches of training.global_batch_size sequences each", AT_LEAST_1)


@dataclass
class OptimConfig:
    name: str = key("adamw", "the optimizer", choices=("adamw",))
    lr: float = key(3e-4, "the peak learning rate, reached at the end of warmup", Bound(0, 10, open_low=True))
    lr_min: float = key(3e-5, "the learning rate the schedule decays to", NON_NEGATIVE)
    warmup_steps: int = key(10, "steps of linear warmup", NON_NEGATIVE)
    schedule: str = key("cosine", "the decay after warmup", choices=("cosine", "constant"))
    weight_decay: float = key(0.1, "AdamW's decoupled weight decay", NON_NEGATIVE)
    beta1: float = key(0.9, "AdamW's first-moment decay", FRACTION)
    beta2: float = key(0.95, "AdamW's second-moment decay", FRACTION)
    eps: float = key(1e-8, "AdamW's epsilon", POSITIVE)
    implementation: str = key("auto", "torch's AdamW kernel", choices=OPTIMIZER_IMPLEMENTATIONS)

    def check(self, steps: int) -> List[str]:
        """Against the run's ``steps`` (training.steps)."""
        out = []
        if self.warmup_steps > steps:
            out.append(f"optim.warmup_steps={self.warmup_steps} is longer than the run (training.steps={steps}); "
                       f"use 0 to {steps} (typically 1-5% of the steps)")
        if not self.lr_min <= self.lr:
            out.append(f"optim.lr_min={self.lr_min} must be between 0 and optim.lr={self.lr}")
        if math.isfinite(self.lr * self.weight_decay) and self.lr * self.weight_decay >= 1:
            out.append(f"optim.weight_decay={self.weight_decay} x optim.lr={self.lr} must be < 1: AdamW scales every "
                       "weight by 1 - lr x weight_decay each step (typical: 0.1 x 3e-4)")
        return out
