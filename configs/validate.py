"""Every config value checked at start-up, before torch is imported or anything is allocated.

Types are the schema's job (configs/schema.py, at compose time); this module checks values:
choices, ranges, and what the keys mean together (batch split, parallel layout, warm-up). All
problems are collected and raised as one ConfigError; train.py prints it as one block, with
no traceback, and exits with code 2. Each message names the key, the value and the fix.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable, List

from omegaconf import DictConfig, OmegaConf

from checkpoint.durable.discovery import resolve_resume
from checkpoint.durable.manifest import CheckpointError
from checkpoint.interop.weight_source import source_problems
from configs.constants import (
    ACTIVATION_CHECKPOINTING,
    ASYNC_MODES,
    BEST_METRICS,
    CHECKPOINT_FORMATS,
    DEVICES,
    GUARD_ACTIONS,
    LOG_LEVELS,
    ON_SAVE_ERROR,
    OPTIMIZER_IMPLEMENTATIONS,
    OPTIMIZERS,
    PARAM_DTYPES,
    PRECISIONS,
    RESUME_WORDS,
    SCHEDULES,
    WANDB_MODES,
    WATCHDOG_PHASES,
)
from data.batching import make_batch_plan
from data.checks import check_data_config, data_path_problem
from data.tokenizer import check_tokenizer_name
from data.validation import validation_problem
from model.config import ModelConfig
from parallel.dims import check_tensor_parallel_fits, resolve_parallel_dims
from recovery.faults import fault_problems
from recovery.interval import parse_interval


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the values and the fix."""


def model_config(cfg: DictConfig) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))


def _choice(problems: List[str], key: str, value, choices) -> None:
    if value not in choices:
        problems.append(f"{key}={value!r}: choose one of {list(choices)}")


def _at_least(problems: List[str], key: str, value, low, why: str = "") -> None:
    if value < low:
        problems.append(f"{key}={value} must be >= {low}" + (f" ({why})" if why else ""))


def _positive(problems: List[str], key: str, value) -> None:
    if not value > 0:
        problems.append(f"{key}={value} must be > 0")


def world_size_of(cfg: DictConfig) -> int | None:
    """The world size train.py will run at: the launcher's WORLD_SIZE, else 1 (plain python); for a
    dry run the layout's product, or None when dp_shard=-1 leaves it open."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.dry_run:
        p = cfg.parallel
        return p.dp_replicate * p.dp_shard * p.tp if p.dp_shard != -1 else None
    return 1


def _training(cfg: DictConfig, problems: List[str], check: Callable) -> None:
    t, o = cfg.training, cfg.optim
    _at_least(problems, "training.steps", t.steps, 1)
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        problems.append(f"optim.warmup_steps={o.warmup_steps} is longer than the run (training.steps={t.steps}); "
                        f"use 0 to {t.steps} (typically 1-5% of the steps)")
    _at_least(problems, "training.seq_len", t.seq_len, 1)
    if t.seq_len > cfg.model.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} is above the model's maximum model.max_seq_len="
                        f"{cfg.model.max_seq_len}; lower training.seq_len or raise model.max_seq_len")
    _choice(problems, "training.mixed_precision", t.mixed_precision, PRECISIONS)
    _at_least(problems, "training.grad_clip", t.grad_clip, 0, "0 disables clipping")
    if not 0 <= t.ema_decay < 1:
        problems.append(f"training.ema_decay={t.ema_decay} must be in [0, 1) (0 disables EMA)")
    _choice(problems, "optim.name", o.name, OPTIMIZERS)
    _choice(problems, "optim.implementation", o.implementation, OPTIMIZER_IMPLEMENTATIONS)
    _choice(problems, "optim.schedule", o.schedule, SCHEDULES)
    _positive(problems, "optim.lr", o.lr)
    if not 0 <= o.lr_min <= o.lr:
        problems.append(f"optim.lr_min={o.lr_min} must be between 0 and optim.lr={o.lr}")
    _at_least(problems, "optim.weight_decay", o.weight_decay, 0)
    for key in ("beta1", "beta2"):
        if not 0 <= o[key] < 1:
            problems.append(f"optim.{key}={o[key]} must be in [0, 1)")
    _positive(problems, "optim.eps", o.eps)


def _parallel(cfg: DictConfig, problems: List[str], check: Callable, world: int | None) -> None:
    p = cfg.parallel
    _choice(problems, "parallel.device", p.device, DEVICES)
    _choice(problems, "parallel.param_dtype", p.param_dtype, PARAM_DTYPES)
    _choice(problems, "parallel.reduce_dtype", p.reduce_dtype, PARAM_DTYPES)
    _choice(problems, "parallel.activation_checkpoint", p.activation_checkpoint, ACTIVATION_CHECKPOINTING)
    _positive(problems, "parallel.collective_timeout_s", p.collective_timeout_s)
    _positive(problems, "parallel.collective_timeout_after_first_step_s", p.collective_timeout_after_first_step_s)
    if world is None:  # the layout is checked once the world size is known
        return
    dims = check(lambda: resolve_parallel_dims(p.dp_replicate, p.dp_shard, p.tp, world))
    if dims is None:
        return
    if not cfg.dry_run:  # a plan is about memory: the micro batch is the user's to adjust after it
        check(lambda: make_batch_plan(cfg.training.global_batch_size, cfg.training.micro_batch_size, dims.dp))
    check(lambda: check_tensor_parallel_fits(model_config(cfg), dims.tp, cfg.training.seq_len))


def _checkpoint(cfg: DictConfig, problems: List[str], check: Callable) -> None:
    c = cfg.checkpoint
    check(lambda: parse_interval(c.interval))
    _choice(problems, "checkpoint.async_mode", c.async_mode, ASYNC_MODES)
    _choice(problems, "checkpoint.format", c.format, CHECKPOINT_FORMATS)
    _at_least(problems, "checkpoint.keep_last", c.keep_last, 1,
              "the newest committed checkpoint is always kept; 0 would keep none")
    _at_least(problems, "checkpoint.keep_every", c.keep_every, 0, "0 turns the permanent tier off")
    _at_least(problems, "checkpoint.keep_best", c.keep_best, 0, "0 turns the best tier off")
    _choice(problems, "checkpoint.best_metric", c.best_metric, BEST_METRICS)
    _choice(problems, "checkpoint.on_save_error", c.on_save_error, ON_SAVE_ERROR)
    _at_least(problems, "checkpoint.load_threads", c.load_threads, 1,
              "read streams per rank while loading; 1 reads each file in one sequential stream")
    _positive(problems, "checkpoint.commit_timeout_s", c.commit_timeout_s)
    m = c.memory
    check(lambda: parse_interval(m.interval, "checkpoint.memory.interval"))
    _choice(problems, "checkpoint.memory.replicas", m.replicas, (0, 1))
    if m.node is not None:
        _at_least(problems, "checkpoint.memory.node", m.node, 0, "a node id names root/node-<id>; null: one per host")
    resume = str(c.resume).strip()
    if resume not in RESUME_WORDS and not resume.isdigit() and not (Path(resume) / "manifest.json").is_file():
        problems.append(f"checkpoint.resume={resume!r}: use one of {list(RESUME_WORDS)}, a step number, or the "
                        "path of a committed checkpoint directory (one holding manifest.json)")


def _eval(cfg: DictConfig, problems: List[str], files: bool) -> None:
    """data.validation, data.validation_fraction, eval.*, and what checkpoint.best_metric=val_loss needs."""
    d, e, c = cfg.data, cfg.eval, cfg.checkpoint
    if not 0 <= d.validation_fraction < 1:
        problems.append(f"data.validation_fraction={d.validation_fraction} must be in [0, 1) (0 holds nothing out)")
    if str(d.validation).strip() == "held_out" and d.prepare_if_missing and not d.validation_fraction > 0:
        problems.append("data.validation=held_out with data.prepare_if_missing=true needs data.validation_fraction > 0 "
                        "(the fraction of documents to hold out, e.g. 0.01)")
    _at_least(problems, "eval.interval", e.interval, 0, "0 turns evaluation off")
    _at_least(problems, "eval.batches", e.batches, 1)
    evaluates = str(d.validation).strip() != "none" and e.interval > 0
    if c.best_metric == "val_loss" and c.keep_best > 0 and not evaluates:
        problems.append("checkpoint.best_metric=val_loss ranks checkpoints by their validation loss, but this run "
                        f"does not evaluate (data.validation={d.validation}, eval.interval={e.interval}); set "
                        "data.validation and eval.interval > 0, or choose best_metric loss or probe_loss")
    if files and not cfg.dry_run:
        prepared_yet = not (d.prepare_if_missing and not (Path(d.path) / "meta.json").is_file())
        problem = validation_problem(d, prepared_yet=prepared_yet)
        if problem:
            problems.append(problem)


def _recovery(cfg: DictConfig, problems: List[str], check: Callable) -> None:
    r = cfg.recovery
    unknown = sorted(set(r.timeouts) - set(WATCHDOG_PHASES))
    if unknown:
        problems.append(f"recovery.timeouts has unknown phases {unknown}: the phases are {list(WATCHDOG_PHASES)}")
    for phase, seconds in r.timeouts.items():
        _positive(problems, f"recovery.timeouts.{phase}", seconds)
    _positive(problems, "recovery.checkpoint_write_timeout_s", r.checkpoint_write_timeout_s)
    _at_least(problems, "recovery.straggler_interval", r.straggler_interval, 0, "0 disables the report")
    if not r.straggler_factor > 1:
        problems.append(f"recovery.straggler_factor={r.straggler_factor} must be > 1")
    for name in r.preemption_signals:
        if not (str(name).startswith("SIG") and hasattr(signal, str(name))):
            problems.append(f"recovery.preemption_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
    _positive(problems, "recovery.preemption_grace_s", r.preemption_grace_s)
    _positive(problems, "recovery.probe_rtol_reshard", r.probe_rtol_reshard)
    _at_least(problems, "recovery.max_fallbacks", r.max_fallbacks, 0)
    _positive(problems, "recovery.device_mtbf_hours", r.device_mtbf_hours)
    _at_least(problems, "recovery.devices", r.devices, 0, "0 uses the world size")
    for i, fault in enumerate(r.faults):
        problems += fault_problems(fault, f"recovery.faults[{i}]")
    g = r.guards
    _choice(problems, "recovery.guards.action", g.action, GUARD_ACTIONS)
    _at_least(problems, "recovery.guards.warmup_steps", g.warmup_steps, 0)
    if not g.grad_norm_multiple > 1:
        problems.append(f"recovery.guards.grad_norm_multiple={g.grad_norm_multiple} must be > 1")
    for key in ("loss_window", "shadow_window"):
        _at_least(problems, f"recovery.guards.{key}", g[key], 3, "a median needs a few values")
    for key in ("shadow_interval", "replica_interval", "rollback_min_age_steps"):
        _at_least(problems, f"recovery.guards.{key}", g[key], 0)
    for key in ("max_consecutive_skips", "max_rollbacks"):
        _at_least(problems, f"recovery.guards.{key}", g[key], 1)


def _init_from_problems(cfg: DictConfig) -> List[str]:
    """model.init_from's shape against model.* (from its JSON files), unless the run will resume:
    then its checkpoint's weights win and the source may even be gone."""
    try:
        if resolve_resume(Path(cfg.checkpoint.dir), str(cfg.checkpoint.resume)) is not None:
            return []
    except CheckpointError:  # the resume itself reports it
        return []
    return source_problems(model_config(cfg), cfg.model.init_from)


def validate_config(cfg: DictConfig, world_size: int | None = None, files: bool = False) -> None:
    """Raise one ConfigError listing every problem of ``cfg`` (a composed training config).

    train.py also passes the run's ``world_size`` (``world_size_of``: the parallel layout, the
    batch split and tensor-parallel divisibility are checked) and ``files=True`` (the data path
    exists, or prepare_if_missing may build it; not for a dry run)."""
    problems: List[str] = []

    def check(fn):
        try:
            return fn()
        except ValueError as exc:
            problems.append(str(exc))
            return None

    check(lambda: model_config(cfg).validate())
    tokenizer_ok = check(lambda: check_tokenizer_name(cfg.data.tokenizer) or True)
    check(lambda: check_data_config(cfg.data))
    # (with an unknown tokenizer, the data path's advice would name it in a prepare command)
    data_problem = data_path_problem(cfg.data) if files and not cfg.dry_run and tokenizer_ok else None
    if data_problem:
        problems.append(data_problem)
    if cfg.model.init_from and files and not cfg.dry_run:
        problems += _init_from_problems(cfg)
    _training(cfg, problems, check)
    _parallel(cfg, problems, check, world_size)
    _checkpoint(cfg, problems, check)
    _eval(cfg, problems, files)
    _recovery(cfg, problems, check)
    _choice(problems, "logging.level", str(cfg.logging.level).upper(), LOG_LEVELS)
    _at_least(problems, "logging.log_interval", cfg.logging.log_interval, 1)
    _choice(problems, "logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    _positive(problems, "logging.peak_tflops", cfg.logging.peak_tflops)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
