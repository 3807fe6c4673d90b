"""Every config value checked at start-up, before torch is imported or anything is allocated.

Types are the schema's job (configs/schema.py, at compose time). Each package checks the values
of its own section (``model/config.py``, ``data/checks.py``, ``training/checks.py``,
``parallel/checks.py``, ``checkpoint/checks.py``, ``recovery/checks.py``, ``metrics/checks.py``),
all torch-free; with ``files=True`` the pre-flight's file probes follow (data.path, the validation
split, checkpoint.resume's directory, model.init_from's shape). Every problem is collected into
one ConfigError; train.py prints it as one block, with no traceback, and exits with code 2.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

import checkpoint.checks
import data.checks
import metrics.checks
import parallel.checks
import recovery.checks
import training.checks
from configs.bounds import bound_problems
from configs.checks import ConfigError, Problems
from configs.schema import numeric_values, unknown_key_problems
from model.config import model_config


def world_size_of(cfg: DictConfig) -> int | None:
    """The world size train.py will run at: the launcher's WORLD_SIZE, else 1 (plain python); for a
    dry run the layout's product, or None when dp_shard=-1 leaves it open."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.dry_run:
        p = cfg.parallel
        return p.dp_replicate * p.dp_shard * p.tp if p.dp_shard != -1 else None
    return 1


def validate_config(cfg: DictConfig, world_size: int | None = None, files: bool = False) -> None:
    """Raise one ConfigError listing every problem of ``cfg`` (a composed training config).

    train.py also passes the run's ``world_size`` (``world_size_of``: the parallel layout, the
    batch split and tensor-parallel divisibility are checked) and ``files=True`` (the pre-flight's
    file probes; the data ones not for a dry run)."""
    problems = Problems(unknown_key_problems(cfg))
    bounds = bound_problems(numeric_values(cfg))
    try:
        _section_problems(cfg, problems, world_size)
    except (ArithmeticError, TypeError, ValueError):  # a value out of bounds broke a check that reads it
        if not bounds:
            raise
    problems += [b for b in bounds if not _named(b.split("=")[0], problems)]  # the packages' words first
    if files:
        problems += data.checks.file_problems(cfg)
        problems += checkpoint.checks.file_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _section_problems(cfg: DictConfig, problems: Problems, world_size: int | None) -> None:
    """Each package's checks of its own section."""
    problems.check(lambda: model_config(cfg).validate())
    data.checks.config_problems(cfg, problems)
    training.checks.config_problems(cfg, problems)
    parallel.checks.config_problems(cfg, problems, world_size)
    checkpoint.checks.config_problems(cfg, problems)
    recovery.checks.config_problems(cfg, problems)
    metrics.checks.config_problems(cfg, problems)


def _named(key: str, problems) -> bool:
    """Whether a message is already about ``key`` (it starts ``key=value`` or ``key (value)``)."""
    return any(p.startswith((f"{key}=", f"{key} (")) for p in problems)
