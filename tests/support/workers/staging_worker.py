"""Run by test_async_process.py under torchrun: the host staging of ``async_process`` saves stays put.

  torchrun --nproc-per-node 2 tests/support/workers/staging_worker.py DIR

Both ranks save a state of DTensors (fp32 and bf16), a 0-dim tensor and bytes twice, through the product's
CheckpointSaver with ``async_process``. Sending the staged dict to DCP's writer process must not move its
buffers: every staged tensor is in shared memory when the stager returns it (so the send has nothing to
move), and after both saves the staging buffers are the storages the first stage returned (data_ptr of
every tensor and its storage, unchanged). The second checkpoint holds the second values, bit for bit.
The worker exits non-zero with the first difference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from checkpoint.durable.discovery import committed_dir
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.saver import CheckpointSaver


def state(mesh, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    full = {"w": torch.randn(8, 6, generator=g), "v": torch.randn(4, 5, generator=g).to(torch.bfloat16)}
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()},
            "optim": {"step": torch.tensor(float(step)), "m": torch.randn(10, generator=g)},
            "blob": b"step %d" % step}


def tensors(obj, path=""):
    """(path, local tensor) of every tensor of ``obj``."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in tensors(v, f"{path}.{k}")]
    if isinstance(obj, DTensor):
        return [(path, obj._local_tensor)]
    return [(path, obj)] if isinstance(obj, torch.Tensor) else []


def pointers(staged: dict) -> dict:
    return {p: (t.data_ptr(), t.untyped_storage().data_ptr()) for p, t in tensors(staged)}


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    saver = CheckpointSaver(root, "async_process", rank, world)
    staged, at_stage, shared_at_stage = [], [], []
    stage = saver.stager.stage

    def recording(sd, **kwargs):  # what the stager hands DCP, before the send to the writer process
        out = stage(sd, **kwargs)
        staged.append(out)
        at_stage.append(pointers(out))
        shared_at_stage.append(sorted(p for p, t in tensors(out) if not t.is_shared()))
        return out

    saver.stager.stage = recording
    for step in (1, 2):
        saver.save(state(mesh, step), Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "h", {}, world, {}, 1, None,
                                               None, None))
        saver.wait()
    after = pointers(staged[0])
    saver.close()
    problems = []
    if shared_at_stage[0]:
        problems.append(f"staged tensors not in shared memory when staged (the send moves them): "
                        f"{shared_at_stage[0]}")
    if after != at_stage[0]:
        moved = sorted(p for p in after if after[p] != at_stage[0][p])
        problems.append("staging buffers moved by the first save (data_ptr, storage data_ptr before -> after): "
                        + "; ".join(f"{p}: {at_stage[0][p]} -> {after[p]}" for p in moved))
    if at_stage[1] != at_stage[0]:
        problems.append("the second save staged into other buffers than the first")
    back = {"model": {k: torch.zeros_like(v) for k, v in state(mesh, 2)["model"].items()},
            "optim": {"step": torch.tensor(0.0), "m": torch.zeros(10)}}
    dcp.load(back, storage_reader=RawFileReader(committed_dir(root, 2)))
    want = state(mesh, 2)
    for (p, got), (_, exp) in zip(tensors(back), tensors({"model": want["model"], "optim": want["optim"]})):
        if not torch.equal(got, exp):
            problems.append(f"{p} of the second save differs")
    if problems:
        raise SystemExit(f"rank {rank}: " + "\n".join(problems))
    dist.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # as storage_worker.py: no interpreter finalization under a live gloo thread
    sys.stderr.flush()
    os._exit(0)
