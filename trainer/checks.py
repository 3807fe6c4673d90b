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
from pathlib import Path
from typing import List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

import checkpoint.checks
import data.checks
import metrics.checks
import parallel.checks
import recovery.checks
import training.checks
from checkpoint import storage
from checkpoint.interop.model_shape import fill_model_shape
from checkpoint.storage import location
from configs.bounds import bound_problems
from configs.checks import ConfigError, Problems
from configs.constants import CHECK_WORLD_SIZES_ENV
from configs.schema import numeric_values, unknown_key_problems
from model.config import model_config


def world_size_of(cfg: DictConfig) -> int | Tuple[int, ...] | None:
    """The world size train.py will run at: the launcher's WORLD_SIZE, else 1 (plain python); for a
    dry run or a launcher's check_only the layout's product, or None when dp_shard=-1 leaves it open;
    for the launcher's check of an elastic range (CHECK_WORLD_SIZES_ENV) each world size it may form."""
    if cfg.check_only and os.environ.get(CHECK_WORLD_SIZES_ENV, "").strip():
        return tuple(int(n) for n in os.environ[CHECK_WORLD_SIZES_ENV].split(","))
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.dry_run or cfg.check_only:
        p = cfg.parallel
        return p.dp_replicate * p.dp_shard * p.tp if p.dp_shard != -1 else None
    return 1


def validate_config(cfg: DictConfig, world_size: int | Tuple[int, ...] | None = None,
                    files: bool = False) -> List[str]:
    """Raise one ConfigError listing every problem of ``cfg`` (a composed training config); return the
    warnings (settings that work but cannot do what they seem to ask).

    train.py also passes the run's ``world_size`` (``world_size_of``: the parallel layout, the
    batch split and tensor-parallel divisibility are checked) and ``files=True`` (the pre-flight's
    file probes; the data, folder and device ones not for a dry run). First, ``model=hf`` gets its
    shape from model.init_from (checkpoint/interop/model_shape.py): the model keys it leaves unset are
    filled in ``cfg`` itself, after a weights-only checkpoint.resume became model.init_from
    (checkpoint/checks.py)."""
    fill_from_files(cfg)
    problems = value_problems(cfg, world_size)
    if files:
        store_ok = not set(storage.setting_problems(cfg.checkpoint)) & set(problems)
        if store_ok:
            storage.configure(cfg.checkpoint)  # the probes of checkpoint.dir or init_from ask the configured store
        problems += file_problems(cfg, store_ok)
    refuse(problems)
    return checkpoint.checks.config_warnings(cfg) + parallel.checks.elastic_warnings(cfg, world_size)


def fill_from_files(cfg: DictConfig) -> None:
    """The config changes the weights make: a weights-only checkpoint.resume becomes model.init_from,
    then model=hf takes its shape from the weights (both read files; under torchrun rank 0 makes them,
    trainer/startup.py)."""
    checkpoint.checks.weights_only_resume(cfg)
    fill_model_shape(cfg)


def value_problems(cfg: DictConfig, world_size: int | None) -> List[str]:
    """Every problem of the values alone (no file is read): the same on every rank."""
    problems = Problems(unknown_key_problems(cfg))
    bounds = bound_problems(numeric_values(cfg))
    try:
        _section_problems(cfg, problems, world_size, [b.split("=")[0] for b in bounds])
    except (ArithmeticError, TypeError, ValueError):  # a value out of bounds broke a check that reads it
        if not bounds:
            raise
    problems += [b for b in bounds if not _named(b.split("=")[0], problems)]  # the packages' words first
    return list(problems)


def refuse(problems: List[str]) -> None:
    """Raise the one ConfigError that lists ``problems`` (none: nothing)."""
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


# What the cross-key checks read: the model's shape, and the layout (the batch split, tensor-parallel fit).
SHAPE_KEYS = ("model.",)
LAYOUT_KEYS = ("model.", "parallel.", "training.global_batch_size", "training.micro_batch_size", "training.seq_len")


def _out_of_bounds(cfg: DictConfig) -> List[str]:
    """The keys whose value is outside its bound (configs/bounds.py), checked before anything reads them."""
    return [b.split("=")[0] for b in bound_problems(numeric_values(cfg))]


def _section_problems(cfg: DictConfig, problems: Problems, world_size, bad: List[str]) -> None:
    """Each package's checks of its own section. A check that combines keys (the model's shape, the layout)
    is left out while one of them (``bad``: the keys out of bounds) is: the bound is the message, and a search
    over an absurd value (the divisors of model.dim=99999999999) must not run."""
    reads_bad = lambda keys: any(k.startswith(keys) for k in bad)  # noqa: E731
    if not reads_bad(SHAPE_KEYS):
        problems.check(lambda: model_config(cfg).validate())
    data.checks.config_problems(cfg, problems)
    training.checks.config_problems(cfg, problems)
    parallel.checks.config_problems(cfg, problems, None if reads_bad(LAYOUT_KEYS) else world_size)
    checkpoint.checks.config_problems(cfg, problems)
    problems += storage.setting_problems(cfg.checkpoint)
    recovery.checks.config_problems(cfg, problems)
    metrics.checks.config_problems(cfg, problems)


def _named(key: str, problems) -> bool:
    """Whether a message is already about ``key`` (it starts ``key=value`` or ``key (value)``)."""
    return any(p.startswith((f"{key}=", f"{key} (")) for p in problems)


def file_problems(cfg: DictConfig, store_ok: bool = True) -> List[str]:
    """The pre-flight's file probes (the data, checkpoint.resume and model.init_from, and for a run the folders
    and the device). A probe that fails is a refusal naming it, not a traceback; one that failed on a value
    out of bounds (reported already) is left out. ``store_ok`` False (a store's settings are wrong, and
    said so): nothing is asked of the object store."""
    probes = {"data.checks.file_problems": lambda: data.checks.file_problems(cfg)}
    if store_ok:
        probes["checkpoint.checks.file_problems"] = lambda: checkpoint.checks.file_problems(cfg)
    if not cfg.dry_run:
        probes.update({"the folders": lambda: folder_problems(cfg), "the device": lambda: device_problems(cfg)})
    out = []
    for name, probe in probes.items():
        try:
            out += probe()
        except Exception as exc:  # noqa: BLE001 - reported in the block
            if isinstance(exc, ConfigError):
                out.append(str(exc))
            elif isinstance(exc, OSError) or not _out_of_bounds(cfg):
                out.append(f"the pre-flight could not finish {name}: {type(exc).__name__}: {exc}")
    return out


def folder_problems(cfg: DictConfig) -> List[str]:
    """output_root, run_dir, checkpoint.dir and a required memory tier's checkpoint.memory.root: folders this
    process can create and write in (each obstacle once: run_dir under a file output_root is the same problem)."""
    out, seen = [], set()
    folders = [(key, OmegaConf.select(cfg, key)) for key in ("output_root", "run_dir", "checkpoint.dir")]
    m = cfg.checkpoint.memory
    if m.root and m.required and _interval_on(m.interval):  # its default, /dev/shm/..., the tier checks
        folders.append(("checkpoint.memory.root", m.root))
    for key, path in folders:
        found = folder_problem(key, path)
        if found and found[0] not in seen:
            seen.add(found[0])
            out.append(found[1])
    return out


def _interval_on(value) -> bool:
    """checkpoint.memory.interval turns the tier on (a step count > 0, or auto); a value the value
    checks refuse is not looked at here."""
    try:
        return checkpoint.checks.parse_interval(value, "checkpoint.memory.interval") != 0
    except ValueError:
        return False


def folder_problem(key: str, path: str) -> Optional[tuple]:
    """(the obstacle, why) when ``path`` cannot be (or become) a folder this process writes in; nothing
    is created here. An s3:// location is checked by the pre-flight, which can ask the store."""
    if location(path).local_path() is None:
        return None
    p = Path(path).absolute()
    for above in [p, *p.parents]:
        if above.exists() or above.is_symlink():
            break
    if not above.is_dir():
        what = "a dangling link" if above.is_symlink() and not above.exists() else "a regular file"
        return above, f"{key}={path}: {above} is {what}, not a folder; point {key} at a folder (or remove {above})"
    if not os.access(above, os.W_OK | os.X_OK):
        where = "the folder" if above == p else f"{above}, where it would be created,"
        why = ("is on a read-only file system" if os.statvfs(above).f_flag & os.ST_RDONLY else
               f"is not writable by this user (uid {os.getuid()})")
        return above, f"{key}={path}: {where} {why}; make it writable or choose another folder"
    return None


def device_problems(cfg: DictConfig, cuda=None) -> List[str]:
    """parallel.device=cuda on a machine without a usable CUDA device; on CUDA (cuda, or auto that picks it),
    more processes on this node (torchrun's LOCAL_WORLD_SIZE, LOCAL_RANK) than devices it sees, where each
    local rank takes device LOCAL_RANK (parallel/init.py). ``cuda``: torch.cuda, or a stand-in (tests).
    torch is imported here, not before."""
    device = cfg.parallel.device
    if device not in ("cuda", "auto"):
        return []
    import torch

    cuda = cuda or torch.cuda
    if not cuda.is_available():
        return [] if device == "auto" else [
            "parallel.device=cuda, but torch sees no CUDA device here (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}); run on a GPU node, or set "
            "parallel.device=auto or cpu"]
    count = cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if max(local_world, local_rank + 1) <= count:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [f"parallel.device={device}: {max(local_world, local_rank + 1)} processes on this node (torchrun "
            f"--nproc-per-node; LOCAL_WORLD_SIZE={local_world}, LOCAL_RANK={local_rank}), but torch sees {count} "
            f"CUDA device{'s' if count != 1 else ''} here"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + f"; each process needs its own: start at most {count} per node (--nproc-per-node={count}, or "
            "--nproc-per-node=gpu), or make more devices visible"]
