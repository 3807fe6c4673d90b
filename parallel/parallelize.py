"""Apply the parallel layout to a meta-built model (before it is materialised).

What to shard how, in the model's module names, is the model's plan (model/parallelize.py); this
applies it with the layout's mesh and the config's options. Order matters: activation checkpointing
and compile wrap each block's forward (compile outermost, so the recomputation is part of the compiled
graph); tensor parallel turns the weights into tp-sharded DTensors; FSDP2 last shards those again
along dp and hooks around each block's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from model.parallelize import parallel_plan
from parallel import collectives
from parallel.activations import apply_activation_checkpointing, apply_compile
from parallel.dims import ParallelDims, check_tensor_parallel_fits
from parallel.fsdp import apply_fsdp, set_grad_sync
from parallel.materialize import materialize
from parallel.mesh import build_mesh, fsdp_mesh


@dataclass
class Parallelized:
    dp_rank: int  # which slice of the global batch this rank reads (same for all ranks of a tp group)
    dp_group: Optional[dist.ProcessGroup]  # sums token counts and losses over data-parallel ranks
    mesh: Optional[DeviceMesh] = None  # (dp_replicate, dp_shard, tp)
    dp_mesh: Optional[DeviceMesh] = None  # all data-parallel ranks, flattened
    loss_parallel: bool = False  # logits are vocabulary-sharded DTensors: use loss_parallel()
    grad_sync_every_micro_batch: bool = True
    cpu_offload: bool = False  # sharded state in host memory (parameters materialised there)
    _sync_set_for_last: Optional[bool] = None  # what set_grad_sync was last told (it walks every module)

    def process_groups(self) -> List[dist.ProcessGroup]:
        """The groups the step's collectives run on: the default group, the mesh's groups and the
        control group (the agreements of save and shadow steps, the straggler report: a hung peer must
        be noticed there as fast)."""
        if not dist.is_initialized():
            return []
        meshes = [m for m in (self.mesh, self.dp_mesh) if m is not None]
        return [dist.group.WORLD, collectives.control_group()] + [g for m in meshes for g in m.get_all_groups()]

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Called by train_step before each micro-batch's backward: skip gradient syncs
        between accumulation micro-steps where FSDP2 allows it. Only when the setting changes:
        setting it walks every module (twice per step with accumulation, off before the first
        micro-batch and on again before the last; never without accumulation)."""
        if last != self._sync_set_for_last:
            set_grad_sync(model, last, self.grad_sync_every_micro_batch)
            self._sync_set_for_last = last


def parallelize_model(model: nn.Module, dims: ParallelDims, parallel_cfg, device: torch.device,
                      seq_len: int) -> Parallelized:
    """Tensor parallel, activation checkpointing, compile and FSDP2, as the config asks.
    Stops with the numbers when tp does not divide the heads (or other split sizes)."""
    check_tensor_parallel_fits(model.cfg, dims.tp, seq_len)
    if parallel_cfg.loss_parallel and not dims.tp_enabled:
        raise ValueError(f"parallel.loss_parallel=true needs parallel.tp > 1 (tp={dims.tp}); set it to false")
    if parallel_cfg.cpu_offload and device.type != "cuda":
        raise ValueError(f"parallel.cpu_offload=true moves state between GPU and host memory; on {device.type} "
                         "the state already lives in host memory: set it to false")
    plan = parallel_plan(model, parallel_cfg.loss_parallel)
    apply_activation_checkpointing(plan.blocks, parallel_cfg.activation_checkpoint)
    if parallel_cfg.compile:
        apply_compile(plan.blocks)
    if dims.world_size == 1 and not dims.fsdp_enabled:  # one process, unwrapped (unless parallel.force_fsdp)
        return Parallelized(dp_rank=0, dp_group=None)
    mesh, dp_mesh = build_mesh(dims, device)
    if dims.tp_enabled:
        parallelize_module(model, mesh["tp"], plan.tensor_parallel)
        plan.after_tensor_parallel()
    if dims.fsdp_enabled:
        apply_fsdp(model, plan, fsdp_mesh(mesh, dims), parallel_cfg.param_dtype, parallel_cfg.reduce_dtype,
                   parallel_cfg.reshard_after_forward, parallel_cfg.cpu_offload)
    return Parallelized(
        dp_rank=dp_mesh.get_local_rank(),
        dp_group=dp_mesh.get_group() if dims.dp > 1 else None,
        mesh=mesh,
        dp_mesh=dp_mesh,
        loss_parallel=parallel_cfg.loss_parallel,
        grad_sync_every_micro_batch=parallel_cfg.grad_sync_every_micro_batch,
        cpu_offload=parallel_cfg.cpu_offload,
    )


def materialize_parallel_model(model: nn.Module, parallel: Parallelized, device: torch.device, seed: int) -> None:
    """Real storage and initial values, each rank its own shards only; the values equal one
    process's with the same seed (parallel/materialize.py)."""
    materialize(model, device, seed, cpu_offload=parallel.cpu_offload)
