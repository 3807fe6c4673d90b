"""Apply the parallel layout to a meta-built model (before it is materialised)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel.dims import ParallelDims


@dataclass
class Parallelized:
    dp_rank: int  # which slice of the global batch this rank reads
    dp_group: Optional[dist.ProcessGroup]  # sums token counts and losses over data-parallel ranks


def parallelize_model(model: nn.Module, dims: ParallelDims, parallel_cfg, device: torch.device) -> Parallelized:
    if dims.world_size == 1:
        return Parallelized(dp_rank=0, dp_group=None)
    raise ValueError(
        f"world size {dims.world_size}: multi-process layouts (dp_replicate={dims.dp_replicate}, "
        f"dp_shard={dims.dp_shard}, tp={dims.tp}) are not wired in yet; run with one process"
    )
