"""Run by test_interop_import.py, alone and under torchrun: model.init_from into a parallelised model.

Builds the debug model (model.* overrides apply) the way trainer/run.py does (meta build,
parallelize, materialize), loads SOURCE with checkpoint/interop/init_from.py, runs one forward pass on
fixed tokens and dumps, from rank 0: the logits, the gathered parameters, and how many bytes of
tensors each rank read. With save=DIR it also saves the imported weights as a committed
checkpoint (the project's saver, every rank writing its shards), for the export round trip.

With model=hf the shape comes from SOURCE (configs/model/hf.yaml, filled as train.py fills it) instead
of the debug preset; seq=N[,M...] gives the logits at each of those lengths (default 48).

  python tests/support/workers/init_from_worker.py OUT.pt SOURCE [model.KEY=V ...] [dp_shard=2 tp=2 ...] [save=DIR]
  torchrun --nproc-per-node 2 tests/support/workers/init_from_worker.py OUT.pt SOURCE dp_shard=2
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.interop.init_from import load_initial_weights
from checkpoint.interop.model_shape import fill_model_shape
from checkpoint.interop.weight_source import open_source
from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model

ROOT = Path(__file__).resolve().parents[3]
SEQ_LEN, SEED = 48, 1234


def tokens(vocab: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(7))


def main() -> None:
    out, source = Path(sys.argv[1]), sys.argv[2]
    args = sys.argv[3:]
    model_args = [a[len("model."):] for a in args if a.startswith("model.")]
    save = next((a.split("=", 1)[1] for a in args if a.startswith("save=")), None)
    seqs = [int(n) for n in next((a.split("=", 1)[1] for a in args if a.startswith("seq=")), str(SEQ_LEN)).split(",")]
    preset_name = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), "debug")
    parallel_args = [a for a in args if not a.startswith(("model.", "save=", "seq=", "model="))]
    pcfg = OmegaConf.merge(OmegaConf.structured(ParallelConfig(device="cpu")), OmegaConf.from_dotlist(parallel_args))
    preset = OmegaConf.merge(OmegaConf.load(ROOT / f"configs/model/{preset_name}.yaml"),
                             OmegaConf.from_dotlist(model_args))
    if preset_name == "hf":
        wrapped = OmegaConf.create({"model": {**OmegaConf.to_container(preset), "init_from": source},
                                    "checkpoint": {"dir": "", "resume": "never"}})
        fill_model_shape(wrapped)
        preset = wrapped.model
    mcfg = ModelConfig(**OmegaConf.to_container(preset))

    world = init_distributed("cpu", pcfg.collective_timeout_s)
    dims = resolve_parallel_dims(pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, world.world_size)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=SEQ_LEN)
    materialize_parallel_model(model, parallel, world.device, seed=SEED)
    read = load_initial_weights(model, open_source(source), world.device)
    with torch.no_grad():
        by_len = {n: model.eval()(tokens(mcfg.vocab_size, n)) for n in seqs}
    logits = by_len[seqs[0]]
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    reads = [read]
    if dist.is_initialized():
        reads = [None] * world.world_size
        dist.all_gather_object(reads, read)
    if save:
        manifest = Manifest("step_00000001", 1, 0, 0, 0.0, "init_from_worker", {"model": dataclasses.asdict(mcfg)},
                            world.world_size, {"dp_shard": dims.dp_shard, "tp": dims.tp}, 1, None, None, None,
                            components=["model"])
        saver = CheckpointSaver(Path(save), "sync", world.rank, world.world_size)
        saver.save({"model": get_model_state_dict(model)}, manifest)
        saver.close()
    if world.is_main:
        torch.save({"logits": logits, "logits_by_len": by_len, "shape": dataclasses.asdict(mcfg), "params": params,
                    "bytes_read": reads, "layout": dims.describe()}, out)
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
