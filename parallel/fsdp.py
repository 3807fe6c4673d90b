"""FSDP2 (``fully_shard``) over the data-parallel mesh: the units the model names
(model/parallelize.py), then the root.

Gradients are SUMMED over data-parallel ranks, not averaged: training/step.py already
divides each micro-batch's summed token loss by the GLOBAL target-token count, so the sum
of the ranks' gradients is the gradient of the global mean loss. FSDP2 averages by default;
``set_gradient_divide_factor(1.0)`` removes the division and
``set_force_sum_reduction_for_comms(True)`` keeps it a plain SUM (gloo has no PREMUL_SUM).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from model.parallelize import ParallelPlan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"parallel.{key}={name!r}: choose one of {list(DTYPES)}")
    return DTYPES[name]


def apply_fsdp(model: nn.Module, plan: ParallelPlan, dp_mesh: DeviceMesh, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: bool, cpu_offload: bool) -> None:
    """Shard parameters, gradients and optimizer state over ``dp_mesh`` (1-D FSDP or 2-D HSDP): the plan's
    units, then the rest under the root."""
    common = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=_dtype(param_dtype, "param_dtype"),
                                                              reduce_dtype=_dtype(reduce_dtype, "reduce_dtype")))
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    for modules, may_reshard in plan.fsdp_units:
        fully_shard(modules, reshard_after_forward=reshard_after_forward and may_reshard, **common)
    fully_shard(model, reshard_after_forward=False, **common)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_grad_sync(model: nn.Module, last_micro_batch: bool, every_micro_batch: bool) -> None:
    """Between accumulation micro-steps: always defer HSDP's all-reduce over replicas (the
    gradients stay sharded, so it costs no memory); defer the reduce-scatter too unless
    ``every_micro_batch`` (deferring it holds unsharded gradients until the last micro-step)."""
    if not isinstance(model, FSDPModule):
        return
    model.set_requires_all_reduce(last_micro_batch)
    if not every_micro_batch:
        model.set_requires_gradient_sync(last_micro_batch)
