"""Tokens/s per parallel layout on CPU, and the framework's overhead against a bare,
hand-written PyTorch loop over the same model and the same batches.

  python scripts/bench_parallel.py                       # all layouts, debug model
  python scripts/bench_parallel.py --layouts 1 dp_shard=2 --steps 20 --rounds 3

Each layout runs under torchrun (gloo). Inside, the framework step as the trainer runs it
(parallelize_model, materialize_parallel_model, build_optimizer, train_step given the global token
count, as the data pipeline gives it, and the run's one GradStats: global-token loss, the loss and
the per-layer gradient norms in one all-reduce and one host read, clipping from that norm) and the
bare loop
(model -> cross_entropy(mean) / accum -> backward -> clip_grad_norm_ -> AdamW, one .item()
per step) alternate step by step (in alternating order), so both see the same machine load;
the median step time of each is reported. The bare loop exists for one process and for FSDP2 (fully_shard per
block + root, stock averaging); for tensor-parallel layouts only tokens/s is reported.
Numbers are for comparing, not for asserting: no test times anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rehearsal.bench import in_turns, model_preset, seconds
from rehearsal.processes import child_env

ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = ["1", "dp_shard=2", "tp=2", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2"]


def _layout_args(layout: str):
    return [] if layout == "1" else layout.split(",")


def _nproc(layout: str) -> int:
    n = 1
    for kv in _layout_args(layout):
        n *= int(kv.split("=")[1])
    return n


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from data.batching import make_batch_plan
    from data.dataset import IGNORE_INDEX
    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.dims import resolve_parallel_dims
    from parallel.init import init_distributed
    from parallel.parallelize import materialize_parallel_model, parallelize_model
    from training.config import OptimConfig
    from training.grad_stats import GradStats
    from training.optimizer import build_optimizer
    from training.schedule import build_scheduler
    from training.step import Precision, train_step

    torch.set_num_threads(1)
    pcfg = OmegaConf.merge(OmegaConf.structured(ParallelConfig(device="cpu")),
                           OmegaConf.from_dotlist(_layout_args(args.layout)))
    mcfg = model_preset(args.model, args.model_set)
    optim_cfg = OmegaConf.structured(OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"))
    world = init_distributed("cpu", 600)
    dims = resolve_parallel_dims(pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, world.world_size)
    plan = make_batch_plan(args.global_batch, args.micro_batch, dims.dp)

    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=args.seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=0)
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, 10**6)
    precision = Precision("fp32", world.device)

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, mcfg.vocab_size, (args.global_batch, args.seq_len + 1), generator=gen)
    per_rank = plan.per_rank_batch_size
    mine = rows[parallel.dp_rank * per_rank:(parallel.dp_rank + 1) * per_rank]
    micro = [(mine[i:i + plan.micro_batch_size, :-1], mine[i:i + plan.micro_batch_size, 1:])
             for i in range(0, per_rank, plan.micro_batch_size)]
    global_tokens = int((rows[:, 1:] != IGNORE_INDEX).sum())  # what the data pipeline tells the trainer
    grad_stats = GradStats(model, world.device, loss_copies=dims.world_size // dims.dp)  # one per run

    def framework_step():
        train_step(model, optimizer, scheduler, precision, micro, 1.0, world.device, parallel.dp_group,
                   before_micro_batch=lambda last: parallel.before_micro_batch(model, last),
                   loss_parallel=parallel.loss_parallel, global_tokens=global_tokens, grad_stats=grad_stats)

    variants = {"framework": framework_step}
    if not dims.tp_enabled:
        bare = build_model(mcfg, seed=0)
        if dims.fsdp_enabled:
            from torch.distributed.fsdp import fully_shard
            mesh = parallel.mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else parallel.mesh["dp_shard"]
            for block in bare.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(bare, mesh=mesh)
        bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

        def bare_step():
            for x, y in micro:
                loss = F.cross_entropy(bare(x).flatten(0, 1), y.flatten()) / len(micro)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)
            loss.item()
        variants["bare"] = bare_step

    for fn in variants.values():
        for _ in range(args.warmup):
            fn()

    def timed(fn):
        if dist.is_initialized():
            dist.barrier()
        return seconds(fn)

    # Step by step, in alternating order: both variants see the same machine load.
    times = in_turns({name: (lambda fn=fn: timed(fn)) for name, fn in variants.items()}, args.rounds * args.steps)
    if world.is_main:
        tokens = args.global_batch * args.seq_len
        out = {"layout": dims.describe(), "world_size": dims.world_size, "tokens_per_step": tokens}
        for name, ts in times.items():
            out[f"{name}_step_s"] = statistics.median(ts)
            out[f"{name}_tokens_per_s"] = tokens / statistics.median(ts)
        if "bare" in times:
            out["overhead_pct"] = 100 * (out["framework_step_s"] / out["bare_step_s"] - 1)
        print("RESULT " + json.dumps(out), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS, help="e.g. 1 dp_shard=2 tp=2 dp_shard=2,tp=2")
    parser.add_argument("--model", default="debug", help="a configs/model/*.yaml preset")
    parser.add_argument("--model-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="change the preset, e.g. dim=256 n_layers=4 n_heads=8 n_kv_heads=4")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = child_env({"OMP_NUM_THREADS": "1"})
    common = ["--model", args.model, "--model-set", *args.model_set, "--global-batch", str(args.global_batch),
              "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--rounds", str(args.rounds)]
    print(f"model {args.model} {' '.join(args.model_set)}, global batch {args.global_batch} x seq {args.seq_len}, "
          f"micro {args.micro_batch}, fp32, gloo, OMP_NUM_THREADS=1; median of {args.rounds}x{args.steps} steps "
          "per variant")
    print(f"{'layout':42s} {'ranks':>5s} {'tokens/s':>10s} {'bare tokens/s':>14s} {'overhead':>9s}")
    for layout in args.layouts:
        n = _nproc(layout)
        cmd = [sys.executable, __file__, "--worker", "--layout", layout, *common]
        if n > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *cmd[1:]]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{layout}: failed ({proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        bare = f"{r['bare_tokens_per_s']:14,.0f}" if "bare_tokens_per_s" in r else f"{'-':>14s}"
        over = f"{r['overhead_pct']:+8.1f}%" if "overhead_pct" in r else f"{'-':>9s}"
        print(f"{r['layout']:42s} {r['world_size']:5d} {r['framework_tokens_per_s']:10,.0f} {bare} {over}", flush=True)


if __name__ == "__main__":
    main()
