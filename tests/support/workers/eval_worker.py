"""Run by test_evaluate.py, alone and under torchrun: the validation loss of a checkpoint's weights
under one parallel layout.

Builds the model as train.py does (parallelize_model, materialize_parallel_model) from the
checkpoint's config, loads the checkpoint's full weights into that layout (stock
torch.distributed.checkpoint.state_dict.set_model_state_dict, which shards them for FSDP2 and
tensor parallel), and evaluates with training/evaluate.py at the run's batch settings.

  python tests/support/workers/eval_worker.py CKPT OUT.json [key=value ...]           # keys of ParallelConfig
  torchrun --nproc-per-node 2 tests/support/workers/eval_worker.py CKPT OUT.json tp=2 loss_parallel=true
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from checkpoint.durable.manifest import read_manifest
from checkpoint.interop.export import load_tensors
from data.batching import make_batch_plan
from data.setup import build_data_pipeline
from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model
from training.evaluate import build_evaluator
from training.step import Precision


def main() -> None:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    pcfg = OmegaConf.merge(OmegaConf.structured(ParallelConfig(device="cpu")), OmegaConf.from_dotlist(sys.argv[3:]))
    cfg = OmegaConf.create(read_manifest(ckpt).config)  # the training run's resolved config
    world = init_distributed("cpu", pcfg.collective_timeout_s)
    dims = resolve_parallel_dims(pcfg.dp_replicate, pcfg.dp_shard, pcfg.tp, world.world_size)
    plan = make_batch_plan(cfg.training.global_batch_size, cfg.training.micro_batch_size, dims.dp)
    mcfg = ModelConfig(**OmegaConf.to_container(cfg.model))
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, pcfg, world.device, seq_len=cfg.training.seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=cfg.seed)
    set_model_state_dict(model, load_tensors(ckpt, "model."), options=StateDictOptions(full_state_dict=True))
    data = build_data_pipeline(cfg.data, cfg.training.seq_len, cfg.seed, plan, parallel.dp_rank, world,
                               model_vocab_size=mcfg.vocab_size)
    evaluator = build_evaluator(cfg.eval, cfg.data, cfg.training.seq_len, cfg.training.steps, model, data, plan,
                                parallel.dp_rank, world.device, parallel.dp_group,
                                Precision(cfg.training.mixed_precision, world.device).autocast, parallel.loss_parallel)
    result = evaluator.evaluate()
    if world.is_main:
        out.write_text(json.dumps({"val_loss": result.loss, "tokens": result.tokens, "layout": dims.describe()}))
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
