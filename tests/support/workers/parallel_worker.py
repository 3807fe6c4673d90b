"""Run by test_parallel.py, alone and under torchrun: each parallel layout needs one process per rank.

Trains the debug model for a few steps under one parallel layout and dumps what the test
compares: per-step loss and grad norm, and the gathered (full) parameters at the end.

Run with plain python (one process: the reference) or under torchrun. It drives the same
functions as train.py (parallelize_model, materialize_parallel_model, train_step, the
optimizer and schedule); only the data is synthetic (a seeded global batch per step, sliced
by dp_rank exactly as data/ does), so the test does not depend on the data pipeline.

  python tests/support/workers/parallel_worker.py OUT.pt [key=value ...]        # keys of ParallelConfig
  torchrun --nproc-per-node 2 tests/support/workers/parallel_worker.py OUT.pt dp_shard=2
  ... model.tie_embeddings=true: a model.* key changes the debug model (here: tied embeddings).
  ... check_timeout=true: afterwards, rank 3 stalls and the others show whether the tightened
  collective timeout fires on the dp sub-group (writes OUT.timeout<rank>.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from data.batching import make_batch_plan
from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed, set_collective_timeout
from parallel.parallelize import materialize_parallel_model, parallelize_model
from training.config import OptimConfig
from training.optimizer import build_optimizer
from training.schedule import build_scheduler
from training.step import Precision, train_step

ROOT = Path(__file__).resolve().parents[3]
STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, SEED = 10, 8, 2, 32, 1234


def global_batch(step: int, vocab: int) -> torch.Tensor:
    """(GLOBAL_BATCH, SEQ_LEN + 1) tokens, a pure function of (seed, step): arithmetic
    progressions (random start and stride) modulo the vocabulary, so the loss falls."""
    gen = torch.Generator().manual_seed(SEED * 1000 + step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ_LEN + 1)) % vocab


def gathered(model: torch.nn.Module) -> dict:
    """Full copies of every parameter (a collective on every rank for sharded ones). Cloned:
    full_tensor() of a replicated DTensor is the live local tensor."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def check_timeout(out: Path, world, parallel) -> None:
    """Rank 3 stalls; its dp partner must fail after the tightened timeout, not hang."""
    groups = set_collective_timeout(1.5, parallel.process_groups())
    group = parallel.dp_group
    if world.rank == 3:
        time.sleep(6)
        os._exit(0)
    t0 = time.perf_counter()
    result = {"rank": world.rank, "raised": False, "groups": groups}
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as exc:
        result.update(raised=True, error=str(exc)[:300])
    result["seconds"] = time.perf_counter() - t0
    Path(f"{out}.timeout{world.rank}.json").write_text(json.dumps(result))
    os._exit(0)


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    pcfg = OmegaConf.merge(OmegaConf.structured(ParallelConfig(device="cpu")),
                           OmegaConf.from_dotlist([a for a in args if not a.startswith(("check_", "model."))]))
    timeout_check = "check_timeout=true" in args
    model_yaml = OmegaConf.merge(OmegaConf.load(ROOT / "configs/model/debug.yaml"),
                                 OmegaConf.from_dotlist([a[len("model."):] for a in args if a.startswith("model.")]))
    mcfg = ModelConfig(**OmegaConf.to_container(model_yaml))
    optim_cfg = OmegaConf.structured(OptimConfig(lr=3e-3, lr_min=3e-4, warmup_steps=2))

    world = init_distributed("cpu", pcfg.collective_timeout_s)
    dims = resolve_parallel_dims(pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, world.world_size)
    plan = make_batch_plan(GLOBAL_BATCH, MICRO_BATCH, dims.dp)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=SEQ_LEN)
    materialize_parallel_model(model, parallel, world.device, seed=SEED)
    initial = gathered(model)
    tied = model.output.weight is model.tok_embeddings.weight
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, STEPS)
    precision = Precision("fp32", world.device)

    losses, grad_norms = [], []
    per_rank = plan.per_rank_batch_size
    for step in range(STEPS):
        rows = global_batch(step, mcfg.vocab_size)[parallel.dp_rank * per_rank:(parallel.dp_rank + 1) * per_rank]
        micro = [(rows[i:i + MICRO_BATCH, :-1], rows[i:i + MICRO_BATCH, 1:]) for i in range(0, per_rank, MICRO_BATCH)]
        result = train_step(model, optimizer, scheduler, precision, micro, 1.0, world.device, parallel.dp_group,
                            before_micro_batch=lambda last: parallel.before_micro_batch(model, last),
                            loss_parallel=parallel.loss_parallel)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)

    final = gathered(model)
    tied = tied and model.output.weight is model.tok_embeddings.weight
    if world.is_main:
        torch.save({"losses": losses, "grad_norms": grad_norms, "initial": initial, "final": final,
                    "layout": dims.describe(), "tied": tied, "n_params": len(list(model.parameters()))}, out)
    if timeout_check:
        check_timeout(out, world, parallel)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()



if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be freeing the last
    # collective's tensors, and taking the GIL while the interpreter shuts down aborts the process
    # ("terminate called without an active exception"; torch 2.13, about 1 run in 10 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
