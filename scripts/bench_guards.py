"""Cost of the silent-corruption guards per training step (target: under 2% at default intervals).

  python scripts/bench_guards.py                      # debug model, 2 x 150 steps per arm
  python scripts/bench_guards.py --dim 512 --layers 8 --steps 60

Trains the same model on the same real text twice, once with the guards off and once with them
on (default config: the per-layer gradient-norm and loss-spike tests every step, the fixed-batch
shadow forward every 50 steps), the two arms side by side in one process, stepping in turns (in
alternating order), so that machine noise hits both alike. Both arms step as the trainer does:
one GradStats built per run (training/grad_stats.py), the global token count given, so the fused
norm pass (which clipping needs anyway) runs in both and the difference is the guards' own work:
the detectors, and the probe's forward (recovery/probe.py) on shadow steps. Reports the median and
mean step time of each arm and the overhead (the mean counts the shadow steps, the median does
not), plus the per-call cost of the fused norm pass and of the probe measured alone.
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

from data.formats.native import TokenFile
from model.config import ModelConfig
from model.llama import build_model
from recovery.guards.config import GuardsConfig
from recovery.guards.guard import TrainingGuards
from recovery.probe import Probe
from rehearsal.bench import against, in_turns
from rehearsal.runs import prepare_debug_data
from training.config import OptimConfig
from training.grad_stats import GradStats
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


def run_arm(args, tokens, guarded: bool, run_dir: Path):
    """One arm's training run, one step per ``next()``: yields each step's seconds."""
    torch.manual_seed(0)
    mcfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                       vocab_size=320, max_seq_len=args.seq)
    model = build_model(mcfg, seed=0)
    ocfg = OmegaConf.structured(OptimConfig(lr=1e-3, warmup_steps=10))
    opt = build_optimizer(model, ocfg)
    sched = build_scheduler(opt, ocfg, args.steps)
    probe = Probe(model, next(batches(tokens, 1, 4, args.seq, seed=99))[0], CPU)
    guards = TrainingGuards(OmegaConf.structured(GuardsConfig()), model, CPU, run_dir, 0, shadow_loss=probe) \
        if guarded else None
    grad_stats = GradStats(model, CPU)  # once per run, as the trainer builds it
    for step, micro in enumerate(batches(tokens, args.steps, args.batch, args.seq, seed=1), start=1):
        t0 = time.perf_counter()
        train_step(model, opt, sched, Precision("fp32", CPU), micro, 1.0, CPU,
                   allow_update=(lambda stats: guards.allow_update(step, stats.loss, stats.layer_norms))
                   if guarded else None, global_tokens=sum(t.numel() for _, t in micro), grad_stats=grad_stats)
        if guarded:
            guards.after_update(step)
        yield time.perf_counter() - t0
    if guarded and guards.raised:
        print(f"  note: {len(guards.raised)} alarm(s) in the guarded arm: {guards.raised[0].describe()}")


def per_call_costs(args, tokens) -> dict:
    model = build_model(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                    n_kv_heads=args.heads // 2, vocab_size=320, max_seq_len=args.seq), seed=0)
    inputs, targets = next(batches(tokens, 1, args.batch, args.seq, seed=2))[0]
    token_loss_sum(model(inputs), targets).backward()
    stats = GradStats(model, CPU)
    loss_sum = torch.zeros((), dtype=torch.float64)
    stats.reduce(loss_sum, 1)  # the first call builds the weight matrix: once per run
    t0 = time.perf_counter()
    for _ in range(50):
        stats.reduce(loss_sum, 1)
    norms_ms = (time.perf_counter() - t0) / 50 * 1e3
    probe = Probe(model, next(batches(tokens, 1, 4, args.seq, seed=99))[0], CPU)
    t0 = time.perf_counter()
    for _ in range(5):
        probe()
    shadow_ms = (time.perf_counter() - t0) / 5 * 1e3
    norms = stats.reduce(loss_sum, 1).layer_norms
    guards = TrainingGuards(OmegaConf.structured(GuardsConfig()), model, CPU, Path("outputs/bench_guards"), 0)
    t0 = time.perf_counter()
    for step in range(1, 201):  # past the warm-up: the detectors compare from step 21 on
        guards.allow_update(step, 2.0 + 1e-3 * (step % 7), {k: v * (1 + 1e-3 * (step % 5)) for k, v in norms.items()})
    detectors_ms = (time.perf_counter() - t0) / 200 * 1e3
    return {"layer_norms_ms": norms_ms, "shadow_forward_ms": shadow_ms, "detectors_ms": detectors_ms}


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
    times = {False: [], True: []}
    for r in range(args.rounds):
        arms = {guarded: run_arm(args, tokens, guarded, run_dir) for guarded in (False, True)}
        # step by step, in alternating order: both arms see the same load
        steps = in_turns({guarded: (lambda arm=arm: next(arm)) for guarded, arm in arms.items()}, args.steps,
                         shift=r * args.steps)
        for guarded, arm in arms.items():
            times[guarded] += steps[guarded][10:]  # warm-up left out
            next(arm, None)  # the arm's end: its alarms noted
    off, on = times[False], times[True]
    t_off, t_on = statistics.median(off), statistics.median(on)
    m_off, m_on = statistics.fmean(off), statistics.fmean(on)
    costs = per_call_costs(args, tokens)
    print(f"model dim {args.dim} x {args.layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.rounds} rounds x {args.steps} steps per arm (1 thread)")
    print(f"  step time, guards off: {t_off * 1e3:8.2f} ms median, {m_off * 1e3:8.2f} ms mean")
    print(f"  step time, guards on:  {t_on * 1e3:8.2f} ms median, {m_on * 1e3:8.2f} ms mean (shadow every 50 steps)")
    print(f"  guards on against off: the mean step {against(m_on / m_off, 1.02)} (the shadow steps counted), the "
          f"median step {against(t_on / t_off, 1.02)}")
    print(f"  per call: the fused norm pass (both arms: clipping reads it too) {costs['layer_norms_ms']:.3f} ms = "
          f"{100 * costs['layer_norms_ms'] / 1e3 / t_off:.2f} % of a step; the probe (shadow check) "
          f"{costs['shadow_forward_ms']:.2f} ms / 50 steps = "
          f"{100 * costs['shadow_forward_ms'] / 1e3 / 50 / t_off:.2f} % of a step; the guards' detectors "
          f"(every step) {costs['detectors_ms']:.3f} ms = {100 * costs['detectors_ms'] / 1e3 / t_off:.2f} % of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
