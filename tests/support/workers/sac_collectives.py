"""Run by test_parallel.py under torchrun (tp=2): how many tensor-parallel collectives a training
step issues in its forward and in its backward, per activation-checkpointing mode.

A dispatch mode pushed before the step sees every functional collective that runs; one that
selective checkpointing saves is served from its cache during the recompute and never reaches
it. Writes {mode: {"forward": {op: n}, "backward": {op: n}}} to OUT.json on rank 0.

  torchrun --nproc-per-node 2 tests/support/workers/sac_collectives.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default":
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def count(mode: str, world, dims, seq_len: int = 32) -> dict:
    pcfg = ParallelConfig(dp_shard=1, tp=2, device="cpu", activation_checkpoint=mode)
    model = build_model(ModelConfig(), materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=0)
    tokens = torch.randint(0, ModelConfig().vocab_size, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    with CountCollectives() as forward:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        if hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()
    out["forward"] = dict(forward.counts)
    with CountCollectives() as backward:
        loss.backward()
    out["backward"] = dict(backward.counts)
    return out


def main() -> None:
    target = Path(sys.argv[1])
    world = init_distributed("cpu", 120.0)
    dims = resolve_parallel_dims(1, 1, 2, world.world_size)
    result = {mode: count(mode, world, dims) for mode in ("none", "selective", "full")}
    if world.is_main:
        target.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
