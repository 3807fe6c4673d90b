"""Global batch arithmetic (contract 5): global = dp * micro * grad_accum, or a clear error.

Which samples a rank reads: the global batch that starts at global sample ``start`` is
``[start, start + G)``. Data-parallel rank ``r`` takes the contiguous slice
``[start + r * G/dp, start + (r+1) * G/dp)`` and cuts it, in order, into
``grad_accum_steps`` micro-batches of ``micro_batch_size``. Over all ranks and micro-steps
that is exactly the global batch, for every dp that divides G.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from configs.keys import divisors


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int  # sequences per forward pass on one rank
    dp_size: int  # data-parallel ranks (dp_replicate * dp_shard)

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size


@dataclass(frozen=True)
class SampleRange:
    """Global samples ``[start, start + count)``: one micro-batch of one rank."""

    start: int
    count: int


def rank_micro_batches(plan: BatchPlan, batch_start: int, dp_rank: int) -> List[SampleRange]:
    """The micro-batches rank ``dp_rank`` reads from the global batch starting at ``batch_start``."""
    if not 0 <= dp_rank < plan.dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {plan.dp_size})")
    first = batch_start + dp_rank * plan.per_rank_batch_size
    m = plan.micro_batch_size
    return [SampleRange(first + j * m, m) for j in range(plan.grad_accum_steps)]


def _valid_micro_batches(global_batch_size: int, dp_size: int) -> List[int]:
    if global_batch_size % dp_size:
        return []
    return divisors(global_batch_size // dp_size) or []


def make_batch_plan(global_batch_size: int, micro_batch_size: int, dp_size: int) -> BatchPlan:
    """Check that the global batch splits evenly; name the numbers and the nearest fixes."""
    for name, value in (("global_batch_size", global_batch_size),
                        ("micro_batch_size", micro_batch_size), ("dp size", dp_size)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if global_batch_size % (dp_size * micro_batch_size) == 0:
        return BatchPlan(global_batch_size, micro_batch_size, dp_size)
    lines = [
        f"training.global_batch_size={global_batch_size} is not divisible by "
        f"dp_size ({dp_size}) x training.micro_batch_size ({micro_batch_size}) = "
        f"{dp_size * micro_batch_size}; grad_accum_steps = global / (dp x micro) must be a whole number."
    ]
    micros = _valid_micro_batches(global_batch_size, dp_size)
    if micros:
        below = [m for m in micros if m <= micro_batch_size]
        near = sorted({below[-1] if below else micros[0], min(micros, key=lambda m: abs(m - micro_batch_size))})
        lines.append(f"Valid micro_batch_size at dp={dp_size}: {near} (all: {micros}).")
    elif global_batch_size % dp_size == 0:
        lines.append(f"A valid micro_batch_size divides {global_batch_size // dp_size} (the global batch per rank).")
    else:
        dps = divisors(global_batch_size)
        lines.append(f"No micro_batch_size works: dp size {dp_size} does not divide the global batch"
                     + (f"; dp sizes that do: {dps}." if dps else "."))
    step = dp_size * micro_batch_size
    lower = (global_batch_size // step) * step
    options = sorted({g for g in (lower, lower + step) if g > 0})
    lines.append(f"Nearest global_batch_size at dp={dp_size}, micro={micro_batch_size}: {options}.")
    raise ValueError(" ".join(lines))
