"""The parallel section (``parallel.*``): the device mesh and how the model is spread over it (torch-free).

world_size = dp_replicate x dp_shard x tp (parallel/dims.py); the layout is checked once the world size
is known (trainer/preflight.py), with the model's shape (tensor-parallel fit) and the batch split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from configs.keys import AT_LEAST_1, SECONDS, Bound, key, section
from model.config import ModelConfig
from parallel.dims import ParallelDims, check_tensor_parallel_fits, resolve_parallel_dims
from parallel.fault_tolerance.config import FaultToleranceConfig  # unit: fault_tolerance

DEVICES = ("auto", "cpu", "cuda")
PARAM_DTYPES = ("fp32", "bf16")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class ParallelConfig:
    dp_replicate: int = key(1, "full model replicas (HSDP's outer dimension): gradients all-reduced", AT_LEAST_1)
    dp_shard: int = key(-1, "FSDP2 ranks: parameters, gradients and optimizer state sharded; -1: fill the world",
                        Bound(1, also=(-1,)))
    tp: int = key(1, "tensor-parallel ranks: every matmul split, the same data on each", AT_LEAST_1)
    device: str = key("auto", "auto (cuda when there is one) | cpu | cuda", choices=DEVICES)
    collective_timeout_s: float = key(600.0, "a collective that takes longer fails (the first step: compile, "
                                      "warm-up)", SECONDS)
    collective_timeout_after_first_step_s: float = key(120.0, "the same, from the second step on", SECONDS)
    param_dtype: str = key("fp32", "FSDP2's gathered parameters (bf16 on GPU; master weights and optimizer stay "
                           "fp32)", choices=PARAM_DTYPES)
    reduce_dtype: str = key("fp32", "FSDP2's gradient reduction", choices=PARAM_DTYPES)
    reshard_after_forward: bool = key(True, "false: keep gathered parameters until backward (more memory)")
    cpu_offload: bool = key(False, "sharded parameters, gradients and optimizer state live in host memory")
    grad_sync_every_micro_batch: bool = key(True, "false: reduce-scatter once per step (holds full gradients)")
    activation_checkpoint: str = key("none", "recompute activations in backward, per block",
                                     choices=ACTIVATION_CHECKPOINTING)
    compile: bool = key(False, "torch.compile each block")
    force_fsdp: bool = key(False, "FSDP2 on a size-1 mesh even with one data-parallel rank (a world of 1 then "
                           "starts a process group of one rank; scripts/gpu_check.py runs mixed precision so)")
    loss_parallel: bool = key(False, "tp > 1: cross entropy on vocabulary-sharded logits")
    fault_tolerance: FaultToleranceConfig = section(  # unit: fault_tolerance
        FaultToleranceConfig, "replica groups managed by torchft")

    def layout(self, world_size: int) -> ParallelDims:
        """The mesh at ``world_size`` ranks (ValueError naming the valid layouts when it does not fit)."""
        return resolve_parallel_dims(self.dp_replicate, self.dp_shard, self.tp, world_size, self.force_fsdp)

    def layout_problems(self, world_size: int, model: ModelConfig, seq_len: int) -> List[str]:
        """The mesh at ``world_size`` and the tensor-parallel fit of the model's shape."""
        try:
            dims = self.layout(world_size)
            check_tensor_parallel_fits(model, dims.tp, seq_len)
        except ValueError as exc:
            return [str(exc)]
        return []
