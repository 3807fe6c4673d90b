"""The probe's peak memory against one training micro-batch's forward, on CPU (peak RSS growth).

Each rank builds a model preset under FSDP2 (dp_shard = the number of ranks), then measures the
growth of its peak RSS (``VmHWM`` of /proc/self/status, reset through /proc/self/clear_refs) over
(a) the forward of one training micro-batch of one sequence, with autograd keeping what backward
needs, and (b) the probe (recovery/probe.py: 4 sequences, one at a time, no grad), and (c) the probe as it
was before (the 4 sequences as one batch, full logits). The bar: (b) at most 1.5x (a).

  torchrun --nproc-per-node 2 scripts/bench_probe_memory.py --model 1b --seq-len 512
  python scripts/bench_probe_memory.py --model debug --seq-len 64      # one process
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_growth(fn) -> int:
    """Peak RSS during ``fn`` minus the RSS before it."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss()
    fn()
    status = Path("/proc/self/status").read_text()
    peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024
    return peak - before


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from model.config import ModelConfig
    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.dims import resolve_parallel_dims
    from parallel.init import init_distributed
    from parallel.parallelize import materialize_parallel_model, parallelize_model
    from recovery.probe import PROBE_SEQUENCES, probe_loss
    from training.step import token_loss_sum

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=None, help="write the result as JSON here (rank 0)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    world = init_distributed("cpu", 1800.0)
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{args.model}.yaml"))
    mcfg = ModelConfig(**raw)
    dims = resolve_parallel_dims(1, world.world_size, 1, world.world_size)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, ParallelConfig(dp_shard=world.world_size, device="cpu"), world.device,
                                 seq_len=args.seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=0)
    rows = torch.randint(0, mcfg.vocab_size, (PROBE_SEQUENCES, args.seq_len + 1),
                         generator=torch.Generator().manual_seed(1))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    kept = []

    def training_forward():
        loss = token_loss_sum(model(inputs[:1]), targets[:1])
        kept.append(loss)  # what backward needs stays alive, as in a step before its backward

    train_b = _peak_growth(training_forward)
    kept.clear()
    model.zero_grad(set_to_none=True)
    probe_b = _peak_growth(lambda: probe_loss(model, (inputs, targets), world.device))

    @torch.no_grad()
    def batched_probe():  # the probe before recovery/probe.py's change: the 4 sequences as one batch
        model.eval()
        float(token_loss_sum(model(inputs), targets))
        model.train()

    batched_b = _peak_growth(batched_probe)
    result = {"model": args.model, "ranks": world.world_size, "seq_len": args.seq_len,
              "training_forward_peak_growth_bytes": train_b, "probe_peak_growth_bytes": probe_b,
              "ratio": round(probe_b / train_b, 3), "batched_probe_peak_growth_bytes": batched_b,
              "batched_ratio": round(batched_b / train_b, 3)}
    if world.is_main:
        print(json.dumps(result, indent=1))
        print(f"{args.model} at {world.world_size} rank(s), seq {args.seq_len}: probe peak growth "
              f"{probe_b / 2**20:.0f} MiB, one training micro-batch's forward {train_b / 2**20:.0f} MiB: "
              f"{probe_b / train_b:.2f}x (bar 1.5x); the 4 sequences as one batch (the previous probe) "
              f"{batched_b / 2**20:.0f} MiB, {batched_b / train_b:.2f}x")
        if args.out:
            Path(args.out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
