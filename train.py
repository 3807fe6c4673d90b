"""Train a Llama-style model. Reads top to bottom like a recipe.

  python train.py +experiment=debug                       # CPU, a few minutes
  torchrun --nproc-per-node 8 train.py +experiment=70b    # see README for multi-node
  python train.py +experiment=70b dry_run=true            # compose and plan, no allocation
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from configs.schema import register
from configs.validate import model_config, validate_config

register()
log = logging.getLogger("trainer")


def dry_run(cfg: DictConfig) -> None:
    """Print the composed config, the model's size and the per-rank plan of the parallel
    layout (parallel/plan.py); nothing is allocated."""
    import os

    from model.counting import count_params, flops_per_token
    from parallel.plan import format_plan, plan_from_config

    mcfg = model_config(cfg)
    params = count_params(mcfg)
    print(OmegaConf.to_yaml(cfg, resolve=True))
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    print(f"model {mcfg.name}: {params.total:,} parameters ({params.total / 1e9:.2f} B), "
          f"{params.non_embedding:,} without embeddings")
    print(f"tokens per step: {tokens_per_step:,}; training FLOPs per token: "
          f"{flops_per_token(mcfg, cfg.training.seq_len):.3e}")
    if cfg.parallel.dp_shard == -1 and "WORLD_SIZE" not in os.environ:
        print("per-rank plan: give the layout (e.g. parallel.dp_shard=64 parallel.tp=8) or WORLD_SIZE; "
              "scripts/plan.py also takes the host-copy and storage bandwidths")
        return
    print(format_plan(plan_from_config(cfg, int(os.environ.get("WORLD_SIZE", 0)) or None)))


def train(cfg: DictConfig, overrides: list[str]) -> None:
    import torch

    from data.batching import make_batch_plan
    from data.setup import build_data_pipeline
    from metrics.logger import MetricsLogger, memory_gib, setup_logging
    from metrics.run_dir import write_run_config
    from model.counting import count_params
    from model.llama import build_model
    from parallel.dims import resolve_parallel_dims
    from parallel.init import init_distributed, set_collective_timeout, shutdown_distributed
    from parallel.parallelize import materialize_parallel_model, parallelize_model
    from training.optimizer import build_optimizer
    from training.schedule import build_scheduler
    from training.step import Precision, train_step
    from checkpoint.manager import CheckpointManager
    from checkpoint.probe import make_probe
    from checkpoint.state import TrainingState
    from training.ema import EMA
    from recovery.faults import maybe_inject
    from recovery.guards import RollbackRequested
    from recovery.guards.guard import build_guards
    from recovery.guards.rollback import roll_back
    from recovery.runtime import RecoveryRuntime

    world = init_distributed(cfg.parallel.device, cfg.parallel.collective_timeout_s)
    setup_logging(cfg.logging.level, world.rank)
    run_dir = Path(cfg.run_dir)
    if world.is_main:
        write_run_config(run_dir, cfg, overrides)

    dims = resolve_parallel_dims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, world.world_size)
    plan = make_batch_plan(cfg.training.global_batch_size, cfg.training.micro_batch_size, dims.dp)
    mcfg = model_config(cfg)

    torch.manual_seed(cfg.seed)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, cfg.parallel, world.device, seq_len=cfg.training.seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=cfg.seed)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.training.steps)
    precision = Precision(cfg.training.mixed_precision, world.device)
    data = build_data_pipeline(cfg.data, cfg.training.seq_len, cfg.seed, plan, parallel.dp_rank, world,
                               model_vocab_size=mcfg.vocab_size)
    ema = EMA(model, cfg.training.ema_decay) if cfg.training.ema_decay > 0 else None
    state = TrainingState(model, optimizer, scheduler, precision.scaler, data, ema,
                          rank=world.rank, world_size=world.world_size)
    metrics = MetricsLogger(run_dir, cfg, world.is_main, cfg.training.steps)
    rt = RecoveryRuntime(cfg, run_dir, world)  # watchdog, preemption signals, fault injection
    ckpt = CheckpointManager(cfg, state, rank=world.rank, world_size=world.world_size, dims=dims,
                             device=world.device, metrics=metrics, fault_hook=maybe_inject,
                             probe=make_probe(model, data, world.device, precision.autocast))
    ckpt.preflight()
    resumed = rt.resume(ckpt, state, ckpt.probe, dims, plan)  # verified, with bounded fallback
    start_step = state.step
    tokens_per_step = plan.global_batch_size * cfg.training.seq_len
    log.info(
        "run %s | world %d = dp_replicate %d x dp_shard %d x tp %d | device %s | %s parameters | "
        "global batch %d seq = %d x micro %d x accum %d | %d tokens/step | seq_len %d | seed %d | "
        "data %s | run dir %s | resume: %s",
        cfg.run_name, world.world_size, dims.dp_replicate, dims.dp_shard, dims.tp, world.device,
        f"{count_params(mcfg).total:,}", plan.global_batch_size, dims.dp, plan.micro_batch_size,
        plan.grad_accum_steps, tokens_per_step, cfg.training.seq_len, cfg.seed,
        data.order.fingerprint[:12], run_dir, resumed,
    )

    guards = build_guards(cfg, model, world, parallel, ckpt, metrics)  # silent corruption, loss spikes

    def allow_update(loss: float) -> bool:
        maybe_inject("gradients", step + 1, model=model)
        return guards.allow_update(step + 1, loss)

    model.train()
    recent: list[float] = []
    step, rollbacks = start_step, 0
    while step < cfg.training.steps:
        t0 = time.perf_counter()
        rt.phase("data_wait", step + 1)
        micro_batches = data.next_micro_batches(step)
        rt.phase("step", step + 1, model)
        result = train_step(model, optimizer, scheduler, precision, micro_batches, cfg.training.grad_clip,
                            world.device, parallel.dp_group, data_seconds=time.perf_counter() - t0,
                            before_micro_batch=lambda last: parallel.before_micro_batch(model, last),
                            loss_parallel=parallel.loss_parallel, allow_update=allow_update)
        if step == start_step:  # warm-up done: a hung peer should now fail fast
            set_collective_timeout(cfg.parallel.collective_timeout_after_first_step_s, parallel.process_groups())
        if ema is not None:
            ema.update()
        state.record_step(result.target_tokens, plan.global_batch_size)
        step_s = time.perf_counter() - t0
        try:
            guards.after_update(step + 1)
        except RollbackRequested as request:
            rt.beat("checkpoint_load", step + 1)  # a rollback load is not a hung step
            step, rollbacks = roll_back(request, guards, ckpt, data, cfg, world.rank, rollbacks), rollbacks + 1
            continue
        if cfg.recovery.halt_on_nonfinite_loss and not math.isfinite(result.loss) and not result.skipped:
            raise FloatingPointError(
                f"loss is {result.loss} at step {step + 1} (grad norm {result.grad_norm}); stopping. "
                "Lower optim.lr, enable grad clipping, or resume from an earlier checkpoint."
            )
        recent = (recent + [step_s])[-20:]
        metrics.log_step(step + 1, {
            "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens_per_s": tokens_per_step / step_s, "step_s": step_s, "data_s": result.data_seconds,
            "memory_gib": memory_gib(world.device), "tokens": (step + 1) * tokens_per_step,
        }, step_seconds_avg=sum(recent) / len(recent))
        rt.before_checkpoint(ckpt, step + 1)
        ckpt.after_step(step + 1, result.loss)
        if rt.after_step(step + 1, step_s, ckpt, result.loss):  # preempted: saved and committed
            break
        step += 1

    rt.beat("shutdown", state.step)  # the last save may take a while: not a hang
    ckpt.close()
    rt.close()
    data.close()
    metrics.close()
    log.info("done: %d steps, run dir %s", cfg.training.steps, run_dir)
    shutdown_distributed()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    validate_config(cfg)
    if cfg.dry_run:
        dry_run(cfg)
        return
    train(cfg, list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
