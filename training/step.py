"""One optimizer step: gradient accumulation, global-token loss normalisation, precision.

The loss of a step is  sum of token losses over the whole global batch / number of target
tokens in the global batch  (contract 5), not a mean of micro-batch means. Each micro-batch
backpropagates its summed loss divided by the *global* token count, so after
accumulation (and a data-parallel gradient *sum*, which the parallel wrappers are set to)
the gradient is exactly the gradient of the global mean, for any dp x accumulation split.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from configs.constants import IGNORE_INDEX, PRECISIONS
from parallel import collectives


class Precision:
    """Autocast context and (for fp16) a GradScaler; parameters and optimizer stay fp32."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in PRECISIONS:
            raise ValueError(f"training.mixed_precision={mode!r}: choose one of {list(PRECISIONS)}")
        self.mode = mode
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None

    def autocast(self):
        if self.mode == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mode == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)


@dataclass
class StepResult:
    loss: float  # mean token loss over the global batch
    grad_norm: float  # global gradient norm before clipping
    lr: float
    target_tokens: int  # over the global batch
    seconds: float
    data_seconds: float
    skipped: bool = False  # the guards vetoed the update (recovery/guards)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, precision: Precision,
               micro_batches: List[Tuple[torch.Tensor, torch.Tensor]], grad_clip: float, device: torch.device,
               dp_group: Optional[dist.ProcessGroup] = None, data_seconds: float = 0.0,
               before_micro_batch: Optional[Callable[[bool], None]] = None,
               loss_parallel: bool = False,
               allow_update: Optional[Callable[[float], bool]] = None) -> StepResult:
    """``before_micro_batch(last)`` lets the parallel wrappers skip gradient syncs between
    accumulation micro-steps; ``loss_parallel``: the logits are vocabulary-sharded DTensors;
    ``allow_update(loss)`` sees the global loss and the (unscaled) gradients before the
    update and may veto it (recovery/guards): the step then consumes its data and its LR
    step but leaves weights and optimizer state untouched."""
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    counts = torch.tensor([sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)],
                          dtype=torch.float64, device=device)
    if dp_group is not None:
        collectives.all_reduce(counts, dp_group)
    global_tokens = counts.item()
    if global_tokens == 0:
        raise ValueError("the global batch has no target tokens (every target is ignored)")

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        if before_micro_batch is not None:
            before_micro_batch(i == len(micro_batches) - 1)
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(inputs)
        with _loss_parallel() if loss_parallel else contextlib.nullcontext():
            micro_loss = token_loss_sum(logits, targets)
            scaled = micro_loss / global_tokens
            if precision.scaler is not None:
                scaled = precision.scaler.scale(scaled)
            scaled.backward()
        loss_sum += _full(micro_loss.detach()).double()

    if dp_group is not None:
        collectives.all_reduce(loss_sum, dp_group)
    loss = loss_sum.item() / global_tokens
    if precision.scaler is not None:
        precision.scaler.unscale_(optimizer)
    skipped = allow_update is not None and not allow_update(loss)  # sees the gradients before clipping
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if precision.scaler is not None:
        if not skipped:
            precision.scaler.step(optimizer)
        precision.scaler.update()
    elif not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return StepResult(
        loss=loss, grad_norm=float(grad_norm), lr=lr, target_tokens=int(global_tokens),
        seconds=time.perf_counter() - start, data_seconds=data_seconds, skipped=skipped,
    )
