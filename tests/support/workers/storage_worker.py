"""Run by test_checkpoint_storage.py under torchrun: raw-bytes chunk reads across layouts need real ranks.

  torchrun --nproc-per-node 2 tests/support/workers/storage_worker.py DIR

Rank 0 first saves full tensors with no process group (DIR/full). Then both ranks:
1. load DIR/full into DTensors sharded on dim 0 (whole rows: read straight into the shard)
   and on dim 1 (a column block of each saved row: read aside, then copied);
2. save those DTensors (DIR/sharded) and rank 0 loads them back into full tensors with no
   process group (each saved chunk lands in a column block or row block of the destination);
3. save twice, through the product's CheckpointSaver, a state of the same structure with other
   values (DIR/cached): DCP's plan caching (checkpoint/durable/saver.py) plans the first save only
   (the coordinator builds one global plan, every rank sends an empty local plan the second time),
   and the second checkpoint holds the second values.
Every comparison is bitwise; the worker exits non-zero on the first difference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from checkpoint.durable.raw import RawFileWriter
from checkpoint.durable.reader import RawFileReader


def full_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w_f32": torch.randn(6, 10, generator=g),
        "w_bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "w_i64": torch.randint(0, 1 << 40, (8, 3), generator=g),
        "b_1d": torch.randn(12, generator=g),
    }


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise SystemExit(f"rank {dist.get_rank()}: {name} differs:\n{got}\n{want}")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_tensors()
    if rank == 0:
        dcp.save({k: v.clone() for k, v in full.items()}, storage_writer=RawFileWriter(out / "full", "xxh3_64"),
                 no_dist=True)
    dist.barrier()

    for dim in (0, 1):
        dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(min(dim, v.dim() - 1))])
                for k, v in full.items()}
        dcp.load(dest, storage_reader=RawFileReader(out / "full"))
        for k, v in dest.items():
            check(f"{k} sharded on dim {dim}", v.full_tensor(), full[k])
        dcp.save(dest, storage_writer=RawFileWriter(out / f"sharded{dim}", "xxh3_64"))
        dist.barrier()
        if rank == 0:
            back = {k: torch.zeros_like(v) for k, v in full.items()}
            dcp.load(back, storage_reader=RawFileReader(out / f"sharded{dim}"), no_dist=True)
            for k, v in back.items():
                check(f"{k} saved sharded on dim {dim}, loaded whole", v, full[k])
        dist.barrier()
    plan_once(out / "cached", mesh, full)
    dist.destroy_process_group()


def plan_once(root: Path, mesh, full: dict) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from checkpoint.durable.discovery import committed_dir
    from checkpoint.durable.manifest import Manifest
    from checkpoint.durable.saver import CheckpointSaver

    rank, world = dist.get_rank(), dist.get_world_size()
    planned, sent = [], []  # global plans the coordinator built; items of each local plan this rank sent
    create_global, create_local = DefaultSavePlanner._create_global_plan, DefaultSavePlanner.create_local_plan
    DefaultSavePlanner._create_global_plan = lambda self, plans: planned.append(1) or create_global(self, plans)
    DefaultSavePlanner.create_local_plan = lambda self: (lambda plan: sent.append(len(plan.items)) or plan)(
        create_local(self))
    saver = CheckpointSaver(root, "sync", rank, world)
    for step in (1, 2):
        state = {"model": {k: distribute_tensor(v * step if v.is_floating_point() else v + step, mesh, [Shard(0)])
                           for k, v in full.items()}}
        saver.save(state, Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "h", {}, world, {}, 1, None, None, None))
    if planned != ([1] if rank == 0 else []) or len(sent) != 2 or sent[0] == 0 or sent[1] != 0:
        raise SystemExit(f"rank {rank}: plan caching: {len(planned)} global plans for two saves, local plans of "
                         f"{sent} items (want 1 global plan on rank 0, the second local plan empty)")
    dist.barrier()
    if rank == 0:
        back = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
        dcp.load(back, storage_reader=RawFileReader(committed_dir(root, 2)), no_dist=True)
        for k, v in full.items():
            check(f"{k} of the second save", back["model"][k], v * 2 if v.is_floating_point() else v + 2)
    dist.barrier()



if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be freeing the last
    # collective's tensors, and taking the GIL while the interpreter shuts down aborts the process
    # ("terminate called without an active exception"; torch 2.13, about 1 run in 10 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
