"""Give a parallelised, meta-built model real storage and its initial values, shard by shard.

Each rank allocates only its own shards and fills them with model/init.py, whose values are a
pure function of (seed, parameter name, position): the global parameters are bitwise those of
one process with the same seed, at any layout, and no rank ever holds more than its shards
plus one band of random tiles (memory O(shard), time O(shard); tests/integration/test_init_memory.py
measures it on the 1b preset). No communication. The same path serves one process (the
"shard" is the whole tensor), FSDP2, TP and HSDP, on CPU and CUDA.

Weights loaded from elsewhere (a converted checkpoint) are copied into the shards after this.
"""

from __future__ import annotations

import torch
from torch import nn

from model.llama import materialize_model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, cpu_offload: bool = False) -> None:
    """Storage on ``device`` and the seed's initial values for every shard this rank holds.
    With ``cpu_offload`` the sharded parameters live in host memory (FSDP2 moves each unit to
    ``device`` for compute) while the buffers (rotary tables) stay on ``device``."""
    materialize_model(model, device, seed=seed, param_device="cpu" if cpu_offload else None)
