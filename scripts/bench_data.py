"""Benchmark the data pipeline: resume cost at step 10 vs 10^6, and loader throughput.

  python scripts/bench_data.py                       # pydoc-byte, debug model shapes
  python scripts/bench_data.py --seq-len 1024 --global-batch 32 --micro-batch 8

Resume: a fresh pipeline loads a state saved at step s and produces its first
micro-batches (worker start-up included); the time must not grow with s, because the
position is a number and the order an O(1) function (no replay). Throughput: tokens/s the
loader delivers alone, and a training loop of the debug model fed by it: its tokens/s and
the share of its time spent waiting for data, measured under the same machine load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from data.batching import make_batch_plan
from data.config import DataConfig
from data.setup import build_data_pipeline
from rehearsal.bench import in_turns
from rehearsal.runs import prepare_debug_data

WORLD = SimpleNamespace(local_rank=0, device=torch.device("cpu"))


def make_pipeline(args, num_workers: int):
    cfg = OmegaConf.structured(DataConfig(path=args.data, num_workers=num_workers))
    plan = make_batch_plan(args.global_batch, args.micro_batch, 1)
    return build_data_pipeline(cfg, args.seq_len, 1234, plan, 0, WORLD, model_vocab_size=1 << 20)


def resume_seconds(args, step: int, num_workers: int) -> tuple[float, float]:
    """(seconds to load the state and locate the next batch, seconds until its data is in hand)."""
    pipe = make_pipeline(args, num_workers)
    state = {**pipe.state_dict(), "step": step, "samples_consumed": step * args.global_batch}
    start = time.perf_counter()
    pipe.load_state_dict(state)
    pipe.upcoming_sample_ids()
    located = time.perf_counter() - start
    pipe.next_micro_batches(step)
    seconds = time.perf_counter() - start
    pipe.close()
    return located, seconds


def loader_tokens_per_s(args, num_workers: int) -> float:
    pipe = make_pipeline(args, num_workers)
    pipe.next_micro_batches(0)  # start-up excluded
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        pipe.next_micro_batches(step)
    seconds = time.perf_counter() - start
    pipe.close()
    return args.steps * args.global_batch * args.seq_len / seconds


def training_loop(args, num_workers: int) -> tuple[float, float]:
    """(tokens/s, share of the time waiting for data) of the debug model training on the pipeline."""
    from hydra import compose, initialize_config_dir

    from model.llama import build_model
    from trainer.config import register
    from training.optimizer import build_optimizer
    from training.schedule import build_scheduler
    from training.step import Precision, train_step

    register()
    with initialize_config_dir(str(Path(__file__).resolve().parent.parent / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=debug"])
    torch.manual_seed(0)
    model = build_model(OmegaConf.to_object(cfg.model))
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 10 ** 6)
    precision = Precision("fp32", torch.device("cpu"))
    pipe = make_pipeline(args, num_workers)
    train_step(model, optimizer, scheduler, precision, pipe.next_micro_batches(0), 1.0, torch.device("cpu"))
    waited = 0.0
    start = time.perf_counter()
    for step in range(1, args.train_steps + 1):
        t0 = time.perf_counter()
        micro = pipe.next_micro_batches(step)
        waited += time.perf_counter() - t0
        train_step(model, optimizer, scheduler, precision, micro, 1.0, torch.device("cpu"))
    seconds = time.perf_counter() - start
    pipe.close()
    return args.train_steps * args.global_batch * args.seq_len / seconds, waited / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="outputs/data/pydoc-byte")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="steps timed for loader throughput")
    parser.add_argument("--train-steps", type=int, default=20, help="training steps timed on the pipeline")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args(argv)
    prepare_debug_data(Path(args.data))  # the debug experiment's data, as train.py would build it

    print(f"data {args.data}, seq_len {args.seq_len}, global batch {args.global_batch} "
          f"(micro {args.micro_batch}), {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    steps = (10, 10 ** 6)
    for workers in args.workers:
        times = in_turns({s: (lambda s=s: resume_seconds(args, s, workers)) for s in steps}, args.repeats)
        locate = {s: statistics.median(t[0] for t in times[s]) for s in steps}
        first = {s: statistics.median(t[1] for t in times[s]) for s in steps}
        print(f"resume, num_workers={workers} (median of {args.repeats}): load state + locate next batch "
              f"{locate[10] * 1e3:.2f} ms at step 10, {locate[10 ** 6] * 1e3:.2f} ms at step 10^6 "
              f"(ratio {locate[10 ** 6] / locate[10]:.2f}); until its data is loaded (loader start-up "
              f"included) {first[10] * 1e3:.1f} ms vs {first[10 ** 6] * 1e3:.1f} ms "
              f"(ratio {first[10 ** 6] / first[10]:.2f})")
    for workers in args.workers:
        tps = loader_tokens_per_s(args, workers)
        train, wait = training_loop(args, workers)
        print(f"num_workers={workers}: loader alone {tps:,.0f} tokens/s over {args.steps} steps; training the "
              f"debug model (fp32, 1 process) on it {train:,.0f} tokens/s over {args.train_steps} steps, "
              f"{100 * wait:.1f}% of that time waiting for data: the loader delivers {tps / train:.0f}x what a "
              f"step consumes. Replaying 10^6 steps instead of resuming would take "
              f"{10 ** 6 * args.global_batch * args.seq_len / tps / 60:.0f} min at this rate.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
