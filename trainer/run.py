"""One training run, read top to bottom like a recipe: build the parts from the config, resume,
run the loop, and shut everything down on every exit path.

train.py (the Hydra entry point) calls ``run``; so does the rehearsal supervisor
(rehearsal/supervisor.py), which forks it from a warm parent.
"""

from __future__ import annotations

import dataclasses
import gc
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
from checkpoint.durable.discovery import step_of
from checkpoint.durable.lease import Heartbeat, group_lease
from checkpoint.durable.manifest import set_manifest_read_fault
from checkpoint.manager import CheckpointManager
from checkpoint.state.training_state import TrainingState
from checkpoint.storage import location
from configs.keys import ConfigError
from data.batching import make_batch_plan
from data.setup import build_data_pipeline
from metrics.logger import MetricsLogger, memory_gib, setup_logging
from metrics.run_dir import write_run_config
from metrics.throughput import Throughput
from model.counting import count_params
from model.llama import build_model
from parallel.init import init_distributed, set_collective_timeout, shutdown_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model
from recovery.faults import FaultInjector
from recovery.guards.guard import build_guards  # unit: guards
from recovery.probe import make_probe
from recovery.runtime import RecoveryRuntime
from trainer.config import Config, as_dict
from trainer.preflight import CONFIG_CHECKED_ENV, check, check_device, check_launch, claim_lease, launched_alone
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


class GarbageCollection:
    """Python's garbage collector on a fixed step schedule (training.gc_interval), as torchtitan does:
    left automatic, it pauses each rank at its own moments, and a pause on one rank stalls every
    collective. Automatic collection is off from the resume (a full collection inside its object
    collectives measured 0.14 s of CPU at 6.2M parameters) to the end of the run; a generation-1 collection
    runs at the end of every ``interval``-th step, the same steps on every rank (0: automatic)."""

    def __init__(self, interval: int):
        self.interval = interval
        if interval > 0:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        if self.interval > 0 and step % self.interval == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.interval > 0:
            gc.enable()


def run(cfg: DictConfig, overrides: List[str], report: Callable[[BaseException], None] = lambda exc: None) -> None:
    """``report(exc)`` says why the run stopped before the shutdown, which may take a while (a store that does not
    answer) or be cut short: the launcher stops every rank once one has exited."""
    shutdown = Shutdown()
    try:
        _run(cfg, overrides, shutdown)
    except BaseException as exc:
        if not isinstance(exc, ConfigError) and not getattr(exc, "agreed", False):  # a refused launch never ran
            log.error("run stopped by %s; shutting down", type(exc).__name__)
        report(exc)
        shutdown.close(exc)
        raise
    shutdown.close(None)


def _run(cfg: DictConfig, overrides: List[str], shutdown: Shutdown) -> None:
    storage.configure(cfg.checkpoint)  # checkpoint.s3.*: where an s3:// checkpoint.dir or init_from is
    # The launch's checks (trainer/preflight.py): a lone process checks everything first; under torchrun
    # the shared files are read on rank 0 once the process group exists, and every rank agrees.
    alone = launched_alone()
    if alone:
        config, warnings = check(cfg, 1, files=True)
    else:
        check_device(cfg)
    p = cfg.parallel
    world = init_distributed(p.device, p.collective_timeout_s, p.force_fsdp)
    shutdown.add(90, "the process group", shutdown_distributed)
    setup_logging(cfg.logging.level, world.rank)
    if not alone:
        config, warnings = check_launch(cfg, world.world_size)
    if world.is_main and not os.environ.get(CONFIG_CHECKED_ENV):  # else the launcher's own check printed them
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
    train(config, overrides, world, shutdown)


def checkpoint_manager(config: Config, state: TrainingState, rank: int, world_size: int, layout, device,
                       **hooks) -> CheckpointManager:
    """The run's CheckpointManager: the checkpoint section, and what it needs of the others (``hooks``:
    metrics, fault_hook, probe)."""
    t, rc = config.training, config.recovery
    return CheckpointManager(config.checkpoint, state, config=as_dict(config), global_batch_size=t.global_batch_size,
                             steps=t.steps, seed=config.seed, run_name=config.run_name,
                             retries=(rc.read_retries, rc.read_retry_backoff_s), rank=rank, world_size=world_size,
                             layout=layout, device=device, **hooks)


def train(config: Config, overrides: List[str], world, shutdown: Shutdown) -> None:
    """The run, from the checked config (every section typed) on a started process group."""
    c, t, p, rc = config.checkpoint, config.training, config.parallel, config.recovery
    resolved = as_dict(config)  # what the manifests and config.yaml record
    lease = location(c.dir)
    if p.fault_tolerance.enabled:  # unit: fault_tolerance (the groups share checkpoint.dir, each its own lease)
        lease = group_lease(lease, p.fault_tolerance.replica_id)
    attempt = claim_lease(c, lease)  # before anything is built or written: a launch that lost it stops here
    if world.is_main:
        heartbeat = Heartbeat(lease, attempt, c.lease_timeout_s)
        shutdown.add(15, "the lease heartbeat", heartbeat.stop)  # after the writer: a save in flight beats too
    run_dir = Path(config.run_dir)
    injector = FaultInjector(rc.faults, run_dir, world.rank)  # recovery.faults; none by default
    set_manifest_read_fault(lambda path: injector.maybe_inject("manifest_read", step_of(path), path=path))
    shutdown.add(95, "the manifest read fault", lambda: set_manifest_read_fault(None))

    dims = p.layout(world.world_size)
    plan = make_batch_plan(t.global_batch_size, t.micro_batch_size, dims.dp)
    mcfg = config.model

    torch.manual_seed(config.seed)
    model = build_model(mcfg, materialize=False)
    parallel = parallelize_model(model, dims, p, world.device, seq_len=t.seq_len)
    materialize_parallel_model(model, parallel, world.device, seed=config.seed)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, t.steps)
    precision = Precision(t.mixed_precision, world.device)
    data = build_data_pipeline(config.data, t.seq_len, config.seed, plan, parallel.dp_rank, world,
                               model_vocab_size=mcfg.vocab_size, allow_global_batch_change=rc.allow_global_batch_change)
    shutdown.add(20, "the data workers", data.close)
    ema = EMA(model, t.ema_decay) if t.ema_decay > 0 else None
    metrics = MetricsLogger(run_dir, config.logging, world.is_main, t.steps, config.run_name, resolved)
    shutdown.add(30, "the metrics files", metrics.close)
    probe = make_probe(model, data, world.device, precision.autocast, parallel.loss_parallel)
    evaluator = build_evaluator(config.eval, config.data, t.seq_len, t.steps, model, data, plan, parallel.dp_rank,
                                world.device, parallel.dp_group, precision.autocast,
                                parallel.loss_parallel)  # None: data.validation=none
    throughput = Throughput(mcfg, t.seq_len, world.world_size, config.logging.peak_tflops)  # MFU
    guards = None  # the silent-corruption and loss-spike guards (recovery/guards/)
    guards = build_guards(rc.guards, run_dir, model, world, parallel, probe, metrics)  # unit: guards
    manager_state = None  # the torchft manager's state: a part of the checkpoints
    if p.fault_tolerance.enabled:  # unit: fault_tolerance (replica groups under torchft; loaded only for them)
        from recovery.fault_tolerance import ManagerState
        manager_state = ManagerState()
        if c.memory.enabled:  # unit: memory (snapshots by group 0, in a folder of its group's own)
            from checkpoint.memory.tier import memory_root
            from recovery.fault_tolerance import group_memory_tier
            memory = group_memory_tier(p.fault_tolerance, c.memory, memory_root(c.memory, config.run_name))
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, memory=memory))
    state = TrainingState(model, optimizer, scheduler, precision.scaler, data, ema, guards, manager_state,
                          optim_config=config.optim, rank=world.rank,
                          world_size=world.world_size)  # everything a checkpoint holds
    probe.weights_version = lambda: state.weights_version  # the probe runs once per set of weights
    ckpt = checkpoint_manager(config, state, world.rank, world.world_size, dims.layout, world.device, metrics=metrics,
                              fault_hook=injector.maybe_inject, probe=probe)
    shutdown.add(10, "the checkpoint writer", ckpt.close)
    rt = RecoveryRuntime(rc, run_dir, world, ckpt, guards, injector, optim=config.optim,
                         steps=t.steps)  # watchdog, preemption signals
    shutdown.add(0, "the watchdog's shutdown phase", lambda: rt.beat("shutdown", state.step))  # saves may take a while
    shutdown.add(80, "the watchdog", rt.close)
    ckpt.preflight(attempt, lease)  # room for the saves to come, on every rank
    metrics.attempt = attempt  # metrics.jsonl rows name it from now on (metrics/records.py)
    collection = GarbageCollection(t.gc_interval)  # before the load too: its pauses would stretch it, on each rank
    shutdown.add(85, "the garbage collection schedule", collection.close)
    resumed = rt.resume(state, probe, dims, plan)  # verified, with bounded fallback
    if mcfg.init_from:  # unit: interop (pretrained weights at step 0; its code is loaded only for them)
        from checkpoint.interop.init_from import apply_init_from
        resumed = apply_init_from(mcfg.init_from, state, ckpt, resumed, world.device,
                                  (rc.read_retries, rc.read_retry_backoff_s))
    replicas = None
    if p.fault_tolerance.enabled:  # unit: fault_tolerance
        from recovery.fault_tolerance import ReplicaGroups
        replicas = ReplicaGroups(p.fault_tolerance, world, state, manager_state, plan, parallel.dp_rank, run_dir)
        ckpt.writes = replicas.writes_checkpoint  # the step's quorum names the one group that saves it
        shutdown.add(85, "the torchft manager", replicas.close)
        if guards is not None and rc.guards.enabled:  # unit: guards (one verdict across the groups, one action)
            from recovery.guards.across_groups import AcrossGroups
            guards.across_groups = AcrossGroups(replicas)
    if world.is_main:  # the launch is accepted (the resume included): now it may say what it runs
        write_run_config(run_dir, resolved, overrides)
    start_step = state.step
    tokens_per_step = plan.global_batch_size * t.seq_len
    log.info(
        "run %s | world %d = %s%s | device %s | %s parameters | "
        "global batch %d seq = %d x micro %d x accum %d | %d tokens/step | seq_len %d | seed %d | "
        "data %s | run dir %s | resume: %s",
        config.run_name, world.world_size, dims.describe().replace("=", " "),
        " (FSDP2 on a size-1 mesh: parallel.force_fsdp)" if dims.fsdp_enabled and dims.dp == 1 else "", world.device,
        f"{count_params(mcfg).total:,}", plan.global_batch_size, dims.dp, plan.micro_batch_size,
        plan.grad_accum_steps, tokens_per_step, t.seq_len, config.seed,
        data.order.fingerprint[:12], run_dir, resumed,
    )

    model.train()
    grad_stats = GradStats(model, world.device, loss_copies=world.world_size // dims.dp)  # loss and norms
    recent: list[float] = []
    step, warmed_up = start_step, False
    while step < t.steps:
        t0 = time.perf_counter()
        rt.phase("data_wait", step + 1)
        if replicas is not None:  # the step's quorum (a rejoining group takes its peers' state here) and split
            step = replicas.start_step(data)
            if step >= t.steps:
                break
        micro_batches = data.next_micro_batches(step)
        rt.phase("step", step + 1, model)
        result = train_step(model, optimizer, scheduler, precision, micro_batches, t.grad_clip,
                            world.device, parallel.dp_group, data_seconds=time.perf_counter() - t0,
                            before_micro_batch=lambda last: parallel.before_micro_batch(model, last),
                            loss_parallel=parallel.loss_parallel,
                            allow_update=lambda stats: rt.allow_update(step + 1, stats),
                            after_backward=lambda: rt.inject("gradients", step + 1, model=model),
                            global_tokens=data.global_target_tokens, grad_stats=grad_stats,
                            step_flags=rt.step_flags,  # preemption and the like ride the step's reduction
                            across_replicas=replicas and replicas.all_reduce, commit=replicas and replicas.commit)
        if replicas is not None:
            replicas.end_step(step, result, data)
            if not result.committed:  # a peer was lost during the step: this group runs it again
                continue
        ckpt.took_step(result.first_loss)  # the probe of a save made after the previous step
        if not warmed_up:  # warm-up done: a hung peer should now fail fast (the first step this process ran: a
            # group that took its peers' state at the quorum starts at theirs)
            set_collective_timeout(p.collective_timeout_after_first_step_s, parallel.process_groups())
            warmed_up = True
        if ema is not None:
            ema.update()
        state.record_step(result.target_tokens, plan.global_batch_size)
        step_s = time.perf_counter() - t0
        back_to = rt.step_boundary(step + 1, data)  # the guards' checks: a rollback's step, or None
        if back_to is not None:
            step = back_to
            continue
        if rc.halt_on_nonfinite_loss and not math.isfinite(result.loss) and not result.skipped:
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
            eval_start = time.perf_counter()
            rt.phase("eval", step + 1)
            val = evaluator.evaluate()
            metrics.log_eval(step + 1, val.loss, val.tokens, val.seconds)
            ckpt.record_eval(step + 1, val.loss)  # the manifest of a save at this step records it
            if not evaluator.due(step + 1):  # run only because a save is due: part of that save's cost
                rt.evaluated_for_save(time.perf_counter() - eval_start)
        if rt.end_of_step(step + 1, step_s, result):  # saves when due; True: preempted, saved, committed
            break
        collection.step(step + 1)
        step += 1
    if replicas is not None:
        replicas.finish(model)
    if state.step >= t.steps:
        ckpt.discard_memory()  # finished: the memory tier's snapshots would only hold the node's memory
    log.info("done: %d steps, run dir %s", state.step, run_dir)

