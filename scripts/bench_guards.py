"""Cost of the silent-corruption guards per training step (target: under 2% at default intervals).

  python scripts/bench_guards.py                      # debug model, 2 x 150 steps per arm
  python scripts/bench_guards.py --dim 512 --layers 8 --steps 60

Trains the same model on the same real text twice per round, once with the guards off and
once with them on (default config: per-layer gradient norms and the loss-spike test every
step, the fixed-batch shadow forward every 50 steps), alternating the arms over several
rounds so that machine noise hits both alike. Reports the median step time of each arm and
the overhead, plus the per-call cost of each check measured alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from configs.schema import GuardsConfig, OptimConfig
from data.token_file import TokenFile
from model.config import ModelConfig
from model.llama import build_model
from recovery.guards import TrainingGuards
from tools.runs import prepare_debug_data
from training.grad_stats import layer_grad_norms
from training.optimizer import build_optimizer
from training.schedule import build_scheduler
from training.step import Precision, token_loss_sum, train_step

CPU = torch.device("cpu")


def batches(tokens: np.ndarray, steps: int, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(tokens) - seq - 1, batch)
        rows = torch.from_numpy(np.stack([tokens[i:i + seq + 1] for i in idx]).astype(np.int64))
        yield [(rows[:, :-1], rows[:, 1:])]


def run_arm(args, tokens, guarded: bool, run_dir: Path) -> list:
    torch.manual_seed(0)
    mcfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                       vocab_size=320, max_seq_len=args.seq)
    model = build_model(mcfg, seed=0)
    ocfg = OmegaConf.structured(OptimConfig(lr=1e-3, warmup_steps=10))
    opt = build_optimizer(model, ocfg)
    sched = build_scheduler(opt, ocfg, args.steps)
    probe = next(batches(tokens, 1, 4, args.seq, seed=99))[0]

    def shadow() -> float:
        with torch.no_grad():
            model.eval()
            loss = token_loss_sum(model(probe[0]), probe[1]).item() / probe[1].numel()
            model.train()
        return loss

    guards = TrainingGuards(OmegaConf.structured(GuardsConfig()), model, CPU, run_dir, 0, shadow_loss=shadow) \
        if guarded else None
    times = []
    for step, micro in enumerate(batches(tokens, args.steps, args.batch, args.seq, seed=1), start=1):
        t0 = time.perf_counter()
        train_step(model, opt, sched, Precision("fp32", CPU), micro, 1.0, CPU,
                   allow_update=(lambda stats: guards.allow_update(step, stats.loss, stats.layer_norms))
                   if guarded else None)
        if guarded:
            guards.after_update(step)
        times.append(time.perf_counter() - t0)
    if guarded and guards.sink.raised:
        print(f"  note: {len(guards.sink.raised)} alarm(s) in the guarded arm: {guards.sink.raised[0].describe()}")
    return times[10:]  # drop warm-up


def per_call_costs(args, tokens) -> dict:
    model = build_model(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                    n_kv_heads=args.heads // 2, vocab_size=320, max_seq_len=args.seq), seed=0)
    inputs, targets = next(batches(tokens, 1, args.batch, args.seq, seed=2))[0]
    token_loss_sum(model(inputs), targets).backward()
    from training.grad_stats import layer_groups
    groups = layer_groups(model)
    t0 = time.perf_counter()
    for _ in range(50):
        layer_grad_norms(groups, CPU)
    norms_ms = (time.perf_counter() - t0) / 50 * 1e3
    probe = next(batches(tokens, 1, 4, args.seq, seed=99))[0]
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(5):
            model(probe[0])
    shadow_ms = (time.perf_counter() - t0) / 5 * 1e3
    return {"layer_norms_ms": norms_ms, "shadow_forward_ms": shadow_ms}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="outputs/data/pydoc-byte")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    prepare_debug_data(Path(args.data))  # the debug experiment's data, as train.py would build it
    tokens = np.asarray(TokenFile(args.data).tokens)
    run_dir = Path("outputs/bench_guards")
    off, on = [], []
    for r in range(args.rounds):
        for guarded in ((False, True) if r % 2 == 0 else (True, False)):
            (on if guarded else off).extend(run_arm(args, tokens, guarded, run_dir))
    t_off, t_on = statistics.median(off), statistics.median(on)
    costs = per_call_costs(args, tokens)
    print(f"model dim {args.dim} x {args.layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.rounds} rounds x {args.steps} steps per arm (1 thread)")
    print(f"  step time, guards off: {t_off * 1e3:8.2f} ms (median)")
    print(f"  step time, guards on:  {t_on * 1e3:8.2f} ms (median; shadow every 50 steps)")
    print(f"  overhead: {100 * (t_on - t_off) / t_off:+.2f} % (target < 2 %)")
    print(f"  per call: layer norms {costs['layer_norms_ms']:.3f} ms = "
          f"{100 * costs['layer_norms_ms'] / 1e3 / t_off:.2f} % of a step; shadow forward "
          f"{costs['shadow_forward_ms']:.2f} ms / 50 steps = "
          f"{100 * costs['shadow_forward_ms'] / 1e3 / 50 / t_off:.2f} % of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
