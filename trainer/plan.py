"""Memory and checkpoint arithmetic for a model under a parallel layout, without hardware.

The model is built on the meta device and parallelised exactly as in training (the same
parallelize_model) on a fake process group of the target world size, so shard sizes come
from the real tensor-parallel plan and FSDP2 sharding, uneven shards included; then bytes
follow from bytes per element:

  parameters  fp32 master shard          4 B/param (FSDP2 keeps the sharded params in fp32)
  gradients   fp32 shard                 4 B/param
  optimizer   AdamW exp_avg + exp_avg_sq 8 B/param
  checkpoint  parameters + optimizer    12 B/param (gradients are not saved)

"Per rank" is rank 0, which holds the largest shard (torch.chunk gives the remainder to
the first ranks). The checkpoint total counts each element once: DCP writes a replicated
tensor (norm weights across tp, everything across dp_replicate) from one rank only.
Snapshot time is the per-rank state over the host-copy bandwidth of one rank (ranks copy in
parallel); write time is the total over the storage system's aggregate bandwidth.
Activations are not counted (they depend on micro-batch, seq_len and checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from configs.schema import ParallelConfig
from model.config import ModelConfig
from model.counting import count_params
from model.llama import build_model
from parallel.dims import ParallelDims, check_tensor_parallel_fits, resolve_parallel_dims
from parallel.parallelize import parallelize_model
from recovery.interval import DEFAULT_DEVICE_MTBF_HOURS, cluster_mtbf_s, young_daly_interval_s

FP32_BYTES = 4
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
DEFAULT_HOST_COPY_GBPS = 25.0  # device-to-host per rank (PCIe 5 x16 ~ 25-50 GB/s in practice)
DEFAULT_STORAGE_GBPS = 50.0  # aggregate write bandwidth of the checkpoint file system
GB = 1e9


@dataclass(frozen=True)
class LayoutPlan:
    model: str
    dims: ParallelDims
    params_total: int
    params_per_rank: int  # rank 0's local elements after TP and FSDP sharding
    param_bytes_per_rank: int
    grad_bytes_per_rank: int
    optimizer_bytes_per_rank: int
    checkpoint_bytes_per_rank: int  # what one rank snapshots (its whole local state)
    checkpoint_bytes_total: int  # what the checkpoint holds, each element once
    host_copy_gbps: float
    storage_gbps: float

    @property
    def state_bytes_per_rank(self) -> int:
        return self.param_bytes_per_rank + self.grad_bytes_per_rank + self.optimizer_bytes_per_rank

    @property
    def snapshot_s(self) -> float:
        """Blocking part of an async save: copy the local state to host memory."""
        return self.checkpoint_bytes_per_rank / (self.host_copy_gbps * GB)

    @property
    def write_s(self) -> float:
        """Background part: the whole checkpoint through the file system."""
        return self.checkpoint_bytes_total / (self.storage_gbps * GB)


def local_param_numels(mcfg: ModelConfig, dims: ParallelDims, seq_len: int, parallel_cfg=None) -> Dict[str, int]:
    """Rank 0's number of elements of every parameter under the layout (meta device, fake
    process group of ``dims.world_size`` ranks: nothing is allocated, nothing is sent)."""
    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group: run it outside a distributed job")
    cfg = parallel_cfg or ParallelConfig(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp,
                                         device="cpu")
    model = build_model(mcfg, materialize=False)
    if dims.world_size == 1:
        return {n: p.numel() for n, p in model.named_parameters()}
    dist.init_process_group("fake", rank=0, world_size=dims.world_size, store=FakeStore())
    try:
        parallelize_model(model, dims, cfg, torch.device("cpu"), seq_len=seq_len)
        return {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def plan_layout(mcfg: ModelConfig, dims: ParallelDims, seq_len: int, parallel_cfg=None,
                host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
                storage_gbps: float = DEFAULT_STORAGE_GBPS) -> LayoutPlan:
    local = sum(local_param_numels(mcfg, dims, seq_len, parallel_cfg).values())
    total = count_params(mcfg).total
    return LayoutPlan(
        model=mcfg.name, dims=dims, params_total=total, params_per_rank=local,
        param_bytes_per_rank=local * FP32_BYTES,
        grad_bytes_per_rank=local * FP32_BYTES,
        optimizer_bytes_per_rank=local * ADAMW_STATE_BYTES,
        checkpoint_bytes_per_rank=local * (FP32_BYTES + ADAMW_STATE_BYTES),
        checkpoint_bytes_total=total * (FP32_BYTES + ADAMW_STATE_BYTES),
        host_copy_gbps=host_copy_gbps, storage_gbps=storage_gbps,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_plan(plan: LayoutPlan) -> str:
    d = plan.dims
    lines = [
        f"layout: {d.describe()} = {d.world_size} ranks (model {plan.model})",
        f"parameters: {plan.params_total:,} total; {plan.params_per_rank:,} per rank "
        f"({plan.params_total / max(plan.params_per_rank, 1):,.1f}x fewer)",
        "per rank (largest shard, fp32 master weights, AdamW; activations not included):",
        f"  parameters {_gib(plan.param_bytes_per_rank)} | gradients {_gib(plan.grad_bytes_per_rank)} | "
        f"optimizer {_gib(plan.optimizer_bytes_per_rank)} | total {_gib(plan.state_bytes_per_rank)}",
        f"checkpoint: {_gib(plan.checkpoint_bytes_per_rank)} per rank, {_gib(plan.checkpoint_bytes_total)} in total "
        f"(parameters + optimizer, 12 B/param)",
        f"  snapshot (blocking) {plan.snapshot_s:,.2f} s at {plan.host_copy_gbps:g} GB/s host copy per rank; "
        f"write {plan.write_s:,.1f} s at {plan.storage_gbps:g} GB/s aggregate storage",
        f"checkpoint interval (Young/Daly, 50,000 h device MTBF): async every "
        f"{checkpoint_interval_s(plan):,.0f} s, sync every {checkpoint_interval_s(plan, asynchronous=False):,.0f} s",
    ]
    return "\n".join(lines)


def checkpoint_interval_s(plan: LayoutPlan, device_mtbf_hours: Optional[float] = None,
                          asynchronous: bool = True) -> float:
    """Young/Daly interval T* = sqrt(2 M C) for this layout (recovery/interval.py): M = device MTBF
    / world size; C = the snapshot (async, and never shorter than the write) or snapshot + write (sync)."""
    mtbf = cluster_mtbf_s(device_mtbf_hours or DEFAULT_DEVICE_MTBF_HOURS, plan.dims.world_size)
    if asynchronous:
        return max(young_daly_interval_s(mtbf, plan.snapshot_s), plan.write_s)
    return young_daly_interval_s(mtbf, plan.snapshot_s + plan.write_s)


def plan_as_dict(plan: LayoutPlan) -> Dict[str, object]:
    out = {k: v for k, v in plan.__dict__.items() if k != "dims"}
    out.update(dp_replicate=plan.dims.dp_replicate, dp_shard=plan.dims.dp_shard, tp=plan.dims.tp,
               world_size=plan.dims.world_size, state_bytes_per_rank=plan.state_bytes_per_rank,
               snapshot_s=plan.snapshot_s, write_s=plan.write_s)
    return out


def world_size_for(dp_replicate: int, dp_shard: int, tp: int, world_size: Optional[int]) -> int:
    """The planner's world: given, or the product of the layout when dp_shard is explicit."""
    if world_size:
        return world_size
    if dp_shard == -1:
        raise ValueError(
            "parallel.dp_shard=-1 fills the world size, which a plan cannot know: give the layout "
            "explicitly (e.g. parallel.dp_shard=64 parallel.tp=8) or the world size (--world-size / WORLD_SIZE)"
        )
    return dp_replicate * dp_shard * tp


def plan_from_config(cfg, world_size: Optional[int] = None, host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
                     storage_gbps: float = DEFAULT_STORAGE_GBPS) -> LayoutPlan:
    """The plan for a composed training config (train.py dry_run and scripts/plan.py)."""
    p = cfg.parallel
    mcfg = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    world = world_size_for(p.dp_replicate, p.dp_shard, p.tp, world_size)
    dims = resolve_parallel_dims(p.dp_replicate, p.dp_shard, p.tp, world)
    check_tensor_parallel_fits(mcfg, dims.tp, cfg.training.seq_len)
    return plan_layout(mcfg, dims, cfg.training.seq_len, p, host_copy_gbps, storage_gbps)
