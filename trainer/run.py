"""One training run, read top to bottom like a recipe: build the parts from the config, resume,
run the loop, and shut everything down on every exit path.

train.py (the Hydra entry point) calls ``run``; so does the rehearsal supervisor
(rehearsal/supervisor.py), which forks it from a warm parent.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch
from omegaconf import DictConfig

from checkpoint import storage
from checkpoint.durable.lease import Heartbeat
from checkpoint.durable.manifest import set_manifest_read_fault, step_of
from checkpoint.interop.init_from import apply_init_from
from checkpoint.manager import CheckpointManager
from checkpoint.state.training_state import TrainingState
from checkpoint.storage import location
from configs.checks import ConfigError
from configs.constants import CONFIG_CHECKED_ENV
from data.batching import make_batch_plan
from data.setup import build_data_pipeline
from metrics.logger import MetricsLogger, memory_gib, setup_logging
from metrics.run_dir import write_run_config
from metrics.throughput import Throughput
from model.config import model_config
from model.counting import count_params
from model.llama import build_model
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed, set_collective_timeout, shutdown_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model
from recovery.faults import FaultInjector
from recovery.guards import RollbackRequested
from recovery.guards.guard import build_guards
from recovery.probe import make_probe
from recovery.runtime import RecoveryRuntime
from trainer.startup import check_device, check_launch, claim_lease, launched_alone
from training.ema import EMA
from training.evaluate import build_evaluator
from training.grad_stats import GradStats
from training.optimizer import build_optimizer
from training.schedule import build_scheduler
from training.step import Precision, train_step

log = logging.getLogger("trainer")


class Shutdown:
    """What must be closed when the run ends, however it ends: the async checkpoint writer
    (its save commits or fails), the data workers, the metrics files, the watchdog and signal
    handlers, the process group. Closed in that order; a close that fails is logged and does
    not hide the exception that ended the run."""

    def __init__(self):
        self.steps: List[tuple] = []  # (order, name, close)

    def add(self, order: int, name: str, close: Callable[[], None]) -> None:
        self.steps.append((order, name, close))

    def close(self, error: BaseException | None) -> None:
        first_failure = None
        for _, name, close in sorted(self.steps, key=lambda s: s[0]):
            try:
                close()
                log.debug("shutdown: closed %s", name)
            except Exception as exc:  # keep closing the rest
                log.error("shutdown: closing %s failed: %s: %s", name, type(exc).__name__, exc)
                first_failure = first_failure or exc
        self.steps.clear()
        if error is None and first_failure is not None:
            raise first_failure


def run(cfg: DictConfig, overrides: List[str]) -> None:
    shutdown = Shutdown()
    try:
        _run(cfg, overrides, shutdown)
    except BaseException as exc:
        if not isinstance(exc, ConfigError) and not getattr(exc, "agreed", False):  # a refused launch never ran
            log.error("run stopped by %s; shutting down", type(exc).__name__)
        shutdown.close(exc)
        raise
    shutdown.close(None)


def _run(cfg: DictConfig, overrides: List[str], shutdown: Shutdown) -> None:
    storage.configure(cfg.checkpoint)  # checkpoint.s3.*: where an s3:// checkpoint.dir or init_from is
    # The launch's checks (trainer/startup.py): a lone process checks everything first; under torchrun
    # the shared files are read on rank 0 once the process group exists, and every rank agrees.
    alone = launched_alone()
    if alone:
        warnings = check_launch(cfg, 1)
    else:
        check_device(cfg)
    world = init_distributed(cfg.parallel.device, cfg.parallel.collective_timeout_s, cfg.parallel.force_fsdp)
    shutdown.add(90, "the process group", shutdown_distributed)
    setup_logging(cfg.logging.level, world.rank)
    if not alone:
        warnings = check_launch(cfg, world.world_size)
    if world.is_main and not os.environ.get(CONFIG_CHECKED_ENV):  # else the launcher's own check printed them
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
    attempt = claim_lease(cfg)  # before anything is built or written: a launch that lost it stops here
    if world.is_main:
        heartbeat = Heartbeat(location(cfg.checkpoint.dir), attempt, cfg.checkpoint.lease_timeout_s)
        shutdown.add(15, "the lease heartbeat", heartbeat.stop)  # after the writer: a save in flight beats too
    run_dir = Path(cfg.run_dir)
    injector = FaultInjector(cfg.recovery.faults, run_dir, world.rank)  # recovery.faults; none by default
    set_manifest_read_fault(lambda path: injector.maybe_inject("manifest_read", step_of(path), path=path))
    shutdown.add(95, "the manifest read fault", lambda: set_manifest_read_fault(None))

    dims = resolve_parallel_dims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, world.world_size,
                                 cfg.parallel.force_fsdp)
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
                               model_vocab_size=mcfg.vocab_size,
                               allow_global_batch_change=cfg.recovery.allow_global_batch_change)
    shutdown.add(20, "the data workers", data.close)
    ema = EMA(model, cfg.training.ema_decay) if cfg.training.ema_decay > 0 else None
    metrics = MetricsLogger(run_dir, cfg, world.is_main, cfg.training.steps)
    shutdown.add(30, "the metrics files", metrics.close)
    probe = make_probe(model, data, world.device, precision.autocast, parallel.loss_parallel)
    evaluator = build_evaluator(cfg, model, data, plan, parallel.dp_rank, world.device, parallel.dp_group,
                                precision.autocast, parallel.loss_parallel)  # None: data.validation=none
    throughput = Throughput(mcfg, cfg.training.seq_len, world.world_size, cfg.logging.peak_tflops)  # MFU
    guards = build_guards(cfg, model, world, parallel, probe, metrics)  # silent corruption, loss spikes
    state = TrainingState(model, optimizer, scheduler, precision.scaler, data, ema, guards, optim_config=cfg.optim,
                          rank=world.rank, world_size=world.world_size)  # everything a checkpoint holds
    probe.weights_version = lambda: state.weights_version  # the probe runs once per set of weights
    ckpt = CheckpointManager(cfg, state, rank=world.rank, world_size=world.world_size, dims=dims,
                             device=world.device, metrics=metrics, fault_hook=injector.maybe_inject, probe=probe)
    shutdown.add(10, "the checkpoint writer", ckpt.close)
    rt = RecoveryRuntime(cfg, run_dir, world, ckpt, guards, injector)  # watchdog, preemption signals
    shutdown.add(0, "the watchdog's shutdown phase", lambda: rt.beat("shutdown", state.step))  # saves may take a while
    shutdown.add(80, "the watchdog", rt.close)
    ckpt.preflight(attempt)  # room for the saves to come, on every rank
    metrics.attempt = attempt  # metrics.jsonl rows name it from now on (metrics/records.py)
    resumed = rt.resume(state, probe, dims, plan)  # verified, with bounded fallback
    resumed = apply_init_from(mcfg.init_from, state, ckpt, resumed, world.device,  # pretrained weights, step 0 only
                              (cfg.recovery.read_retries, cfg.recovery.read_retry_backoff_s))
    if world.is_main:  # the launch is accepted (the resume included): now it may say what it runs
        write_run_config(run_dir, cfg, overrides)
    start_step = state.step
    tokens_per_step = plan.global_batch_size * cfg.training.seq_len
    log.info(
        "run %s | world %d = dp_replicate %d x dp_shard %d x tp %d%s | device %s | %s parameters | "
        "global batch %d seq = %d x micro %d x accum %d | %d tokens/step | seq_len %d | seed %d | "
        "data %s | run dir %s | resume: %s",
        cfg.run_name, world.world_size, dims.dp_replicate, dims.dp_shard, dims.tp,
        " (FSDP2 on a size-1 mesh: parallel.force_fsdp)" if dims.fsdp_enabled and dims.dp == 1 else "", world.device,
        f"{count_params(mcfg).total:,}", plan.global_batch_size, dims.dp, plan.micro_batch_size,
        plan.grad_accum_steps, tokens_per_step, cfg.training.seq_len, cfg.seed,
        data.order.fingerprint[:12], run_dir, resumed,
    )

    model.train()
    grad_stats = GradStats(model, world.device, loss_copies=world.world_size // dims.dp)  # loss and norms
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
                            loss_parallel=parallel.loss_parallel,
                            allow_update=lambda stats: rt.allow_update(step + 1, stats),
                            after_backward=lambda: rt.inject("gradients", step + 1, model=model),
                            global_tokens=data.global_target_tokens, grad_stats=grad_stats)
        if step == start_step:  # warm-up done: a hung peer should now fail fast
            set_collective_timeout(cfg.parallel.collective_timeout_after_first_step_s, parallel.process_groups())
        if ema is not None:
            ema.update()
        state.record_step(result.target_tokens, plan.global_batch_size)
        step_s = time.perf_counter() - t0
        try:
            guards.after_update(step + 1)
        except RollbackRequested as request:
            step, rollbacks = rt.roll_back(request, data, rollbacks), rollbacks + 1
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
            **throughput(tokens_per_step / step_s),
        }, step_seconds_avg=sum(recent) / len(recent))
        if evaluator is not None and evaluator.due(step + 1, saving=ckpt.due(step + 1)):
            rt.phase("eval", step + 1)
            val = evaluator.evaluate()
            metrics.log_eval(step + 1, val.loss, val.tokens, val.seconds)
            ckpt.record_eval(step + 1, val.loss)  # the manifest of a save at this step records it
        if rt.end_of_step(step + 1, step_s, result.loss):  # saves when due; True: preempted, saved, committed
            break
        step += 1
    if state.step >= cfg.training.steps:
        ckpt.discard_memory()  # finished: the memory tier's snapshots would only hold the node's memory
    log.info("done: %d steps, run dir %s", state.step, run_dir)

