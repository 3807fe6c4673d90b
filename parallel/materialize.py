"""Give a sharded, meta-built model real storage and the SAME initial values as a
single-process model built with the same seed.

Random init on DTensors does not reproduce the single-process values (on CPU every shard
would even draw the same numbers). So each rank builds the full model once, on the same
device type, with ``model.llama.build_model(cfg, device, seed=seed)`` (the single-process
path, bit for bit) and keeps only its own shard of each tensor: no communication, the full
model in memory once per rank, transiently. Fine up to a few billion parameters; a 70B model
does not fit a host this way. For
those the path is to initialise per shard on the accelerator (DTensor's CUDA RNG tracker gives
each shard its own slice of one random stream) or to start from a converted checkpoint; that
path is not implemented here yet (docs/parallelism.md).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.llama import build_model


@torch.no_grad()
def materialize_sharded(model: nn.Module, device: torch.device, seed: int, cpu_offload: bool = False) -> None:
    """With ``cpu_offload`` the sharded parameters live in host memory (FSDP2 moves each unit
    to ``device`` for compute) while the buffers (rotary tables) stay on ``device``."""
    model.to_empty(device="cpu" if cpu_offload else device)
    reference = build_model(model.cfg, device=device, seed=seed)
    full_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = full_params[name]
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the full tensor, so just take the local chunk.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
    for name, buffer in reference.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        persistent = leaf not in owner._non_persistent_buffers_set
        owner.register_buffer(leaf, buffer, persistent=persistent)
