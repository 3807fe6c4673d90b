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
from checkpoint.interop.model_shape import fill_model_shape
from configs.checks import ConfigError, Problems
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
    file probes; the data ones not for a dry run). First, ``model=hf`` gets its shape from model.init_from
    (checkpoint/interop/model_shape.py): the model keys it leaves unset are filled in ``cfg`` itself, after
    a weights-only checkpoint.resume became model.init_from (checkpoint/checks.py)."""
    checkpoint.checks.weights_only_resume(cfg)
    fill_model_shape(cfg)
    problems = Problems()
    problems.check(lambda: model_config(cfg).validate())
    data.checks.config_problems(cfg, problems)
    training.checks.config_problems(cfg, problems)
    parallel.checks.config_problems(cfg, problems, world_size)
    checkpoint.checks.config_problems(cfg, problems)
    recovery.checks.config_problems(cfg, problems)
    metrics.checks.config_problems(cfg, problems)
    if files:
        problems += data.checks.file_problems(cfg)
        problems += checkpoint.checks.file_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
