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
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel_loss

from data.dataset import IGNORE_INDEX
from parallel import collectives
from training.grad_stats import GradStats, StepStats


class Precision:
    """Autocast context and (for fp16) a GradScaler; parameters and optimizer stay fp32."""

    def __init__(self, mode: str, device: torch.device):
        """``mode``: training.mixed_precision (fp32, bf16 or fp16)."""
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
    flags: Tuple[bool, ...] = ()  # each of ``step_flags()``: true on some rank
    local_seconds: float = 0.0  # this rank's own work, before it waits for its peers (the straggler report)
    committed: bool = True  # false: the replica groups voted the step away (recovery/fault_tolerance.py)
    # the summed token loss of this rank's first micro-batch (float64), computed before the update: an async
    # save's probe (recovery/probe.py NEXT_MICRO_BATCH), read on the host only by the manager that needs it
    first_loss: Optional[torch.Tensor] = None


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def global_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a loss under loss parallel is one); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, precision: Precision,
               micro_batches: List[Tuple[torch.Tensor, torch.Tensor]], grad_clip: float, device: torch.device,
               dp_group: Optional[dist.ProcessGroup] = None, data_seconds: float = 0.0,
               before_micro_batch: Optional[Callable[[bool], None]] = None,
               loss_parallel: bool = False,
               allow_update: Optional[Callable[[StepStats], bool]] = None,
               global_tokens: Optional[int] = None, grad_stats: Optional[GradStats] = None,
               after_backward: Optional[Callable[[], None]] = None,
               step_flags: Optional[Callable[[], Sequence[bool]]] = None,
               across_replicas: Optional[Callable[[List[torch.Tensor]], None]] = None,
               commit: Optional[Callable[[], bool]] = None) -> StepResult:
    """``before_micro_batch(last)`` lets the parallel wrappers skip gradient syncs between
    accumulation micro-steps; ``loss_parallel``: the logits are vocabulary-sharded DTensors;
    ``after_backward()`` runs once the gradients are complete (fault injection);
    ``allow_update(stats)`` sees the global loss and the per-layer norms of the (unscaled)
    gradients before the update and may veto it (recovery/guards): the step then consumes its
    data and its LR step but leaves weights and optimizer state untouched.

    The trainer passes ``global_tokens`` (the global batch's target count, known on the host from
    the data pipeline) and its ``grad_stats`` (training/grad_stats.py): the step then issues one
    collective of its own (loss and norms) and syncs with the host once. Without them (a direct
    caller), the token count is all-reduced over ``dp_group`` first. ``step_flags()``, read just
    before that collective, gives this rank's flags for it to carry (``flags`` in the result: true
    where any rank's is).

    ``local_seconds`` is the time no peer can stretch: ``data_seconds`` (the loop's work before the
    step, which issues no collective) plus, on CUDA, the device time of forward and backward (two
    events on the compute stream). On CPU the forward and backward are left out: their wall time
    includes FSDP's collectives, which wait for the slowest rank.

    Under parallel.fault_tolerance (recovery/fault_tolerance.py), ``across_replicas(tensors)`` sums this rank's
    loss and gradient shards over the replica groups in place, once backward is done; ``commit()``, after the
    step's reduction, says whether this group may apply it (torchft's vote): when not, the gradients are dropped
    and nothing else changes (no update, no LR step), and the result says ``committed=False``."""
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    if global_tokens is None:
        global_tokens = sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)
        if dp_group is not None:
            counts = torch.tensor([global_tokens], dtype=torch.float64, device=device)
            global_tokens = int(collectives.all_reduce(counts, dp_group).item())
    if global_tokens == 0:
        raise ValueError("the global batch has no target tokens (every target is ignored)")
    stats_of = grad_stats or GradStats(model, device, loss_copies=_loss_copies(dp_group))

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    first_loss = None
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else []
    if events:
        events[0].record()
    for i, (inputs, targets) in enumerate(micro_batches):
        if before_micro_batch is not None:
            before_micro_batch(i == len(micro_batches) - 1)
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(inputs)
        with vocab_parallel_loss() if loss_parallel else contextlib.nullcontext():
            micro_loss = token_loss_sum(logits, targets)
            scaled = micro_loss / global_tokens
            if precision.scaler is not None:
                scaled = precision.scaler.scale(scaled)
            scaled.backward()
        micro_sum = global_value(micro_loss.detach()).double()
        first_loss = micro_sum if first_loss is None else first_loss
        loss_sum += micro_sum
    if events:
        events[1].record()

    if after_backward is not None:  # (before the sum across replica groups: a fault there reaches every group)
        after_backward()
    if across_replicas is not None:
        across_replicas([loss_sum] + [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters()
                                      if p.grad is not None])
    if precision.scaler is not None:
        precision.scaler.unscale_(optimizer)
    stats = stats_of.reduce(loss_sum, global_tokens, step_flags() if step_flags is not None else ())
    # (the one collective and the one host sync, after which the events' times can be read)
    device_seconds = events[0].elapsed_time(events[1]) / 1000 if events else 0.0
    if commit is not None and not commit():
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=stats.loss, grad_norm=stats.grad_norm, lr=lr, target_tokens=int(global_tokens),
                          seconds=time.perf_counter() - start, data_seconds=data_seconds, flags=stats.flags,
                          local_seconds=data_seconds + device_seconds, committed=False)
    skipped = allow_update is not None and not allow_update(stats)  # sees the gradients before clipping
    if grad_clip > 0:
        stats_of.clip(stats.grad_norm, grad_clip)
    if precision.scaler is not None:
        if not skipped:
            precision.scaler.step(optimizer)
        precision.scaler.update()
    elif not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return StepResult(
        loss=stats.loss, grad_norm=stats.grad_norm, lr=lr, target_tokens=int(global_tokens),
        seconds=time.perf_counter() - start, data_seconds=data_seconds, skipped=skipped, flags=stats.flags,
        local_seconds=data_seconds + device_seconds, first_loss=first_loss,
    )


def _loss_copies(dp_group: Optional[dist.ProcessGroup]) -> int:
    """Ranks holding the same data-parallel slice of the loss (the tp ranks): each adds 1/copies."""
    world = collectives.world(None)
    return world // collectives.world(dp_group) if dp_group is not None else world
