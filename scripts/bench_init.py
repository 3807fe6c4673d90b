"""Memory and time of initialising a model preset under a layout, per rank (CPU, gloo).

  python scripts/bench_init.py --model 1b --dp-shard 4             # starts torchrun itself
  python scripts/bench_init.py --model 1b --dp-shard 4 --set n_layers=2 --json out.json

Each rank builds the model on the meta device, parallelises it (parallelize_model, the same
FSDP2/TP plan as training) and materialises it (materialize_parallel_model). Around the last
step it resets the kernel's peak-RSS counter (/proc/self/clear_refs, Linux) and reports the
peak RSS growth (VmHWM after minus VmRSS before), the bytes of the rank's own shards, and the
wall time, next to the time torch's own host RNG (one ``normal_()``, not layout-invariant)
takes for as many elements on the same rank; the full fp32 model is 4 bytes x parameters.
tests/integration/test_init_memory.py asserts the memory bound on the `1b` preset; nothing asserts the time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rehearsal.bench import model_preset
from rehearsal.processes import child_env


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from model.counting import count_params
    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.dims import resolve_parallel_dims
    from parallel.init import init_distributed
    from parallel.parallelize import materialize_parallel_model, parallelize_model

    mcfg = model_preset(args.model, args.set)
    pcfg = ParallelConfig(device="cpu", dp_shard=args.dp_shard, tp=args.tp)
    world = init_distributed("cpu", pcfg.collective_timeout_s)
    dims = resolve_parallel_dims(pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, world.world_size)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=64)

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    rss_before = _status_kib("VmRSS")
    start = time.perf_counter()
    materialize_parallel_model(model, parallel, world.device, seed=args.seed)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    shard_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters())
    # The reference: torch's own host RNG filling the same number of fp32 elements in one call
    # (no tiles, not layout-invariant), on the same core at the same time.
    del model
    baseline = torch.empty(shard_bytes // 4)
    start = time.perf_counter()
    baseline.normal_()
    normal_seconds = time.perf_counter() - start
    result = {"rank": world.rank, "world_size": world.world_size, "model": mcfg.name, "layout": dims.describe(),
              "params": count_params(mcfg).total, "full_fp32_bytes": 4 * count_params(mcfg).total,
              "shard_bytes": shard_bytes, "rss_growth_bytes": (peak - rss_before) * 1024, "init_seconds": seconds,
              "torch_normal_seconds": normal_seconds}
    results = [None] * world.world_size if dist.is_initialized() else [result]
    if dist.is_initialized():
        dist.all_gather_object(results, result)
        dist.barrier()
        dist.destroy_process_group()
    if world.rank == 0:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        for r in results:
            print(f"rank {r['rank']}: init {r['init_seconds']:.1f} s, peak RSS growth "
                  f"{r['rss_growth_bytes'] / 1e9:.2f} GB = {r['rss_growth_bytes'] / r['full_fp32_bytes']:.2f} x the "
                  f"full fp32 model ({r['full_fp32_bytes'] / 1e9:.2f} GB); own shards {r['shard_bytes'] / 1e9:.2f} GB; "
                  f"{r['init_seconds'] / r['torch_normal_seconds']:.1f}x the time of one torch normal_() over as "
                  f"many elements ({r['torch_normal_seconds']:.1f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="a preset in configs/model/")
    p.add_argument("--set", nargs="*", default=[], help="model overrides, e.g. n_layers=2")
    p.add_argument("--dp-shard", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the per-rank results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    nproc = args.dp_shard * args.tp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=child_env()).returncode)


if __name__ == "__main__":
    main()
