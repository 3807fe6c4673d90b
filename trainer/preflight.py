"""Every check of a launch, made once, before anything is built or written; under torchrun, agreed.

Under torchrun every rank starts from the same config but not from the same view of the files: a read
that fails on one rank (EIO, a stale handle), or an answer that depends on the host (is the lease's owner a
dead process here?), would send that rank another way than its peers, and 512 ranks would read the same
manifests. So a launch is checked in this order (trainer/run.py):

1. ``check_device``: what starting the process group needs (parallel.device, the collective timeout), on
   each host. A lone process (no launcher) runs ``check`` here instead, whole.
2. The process group starts (parallel/init.py).
3. ``check_launch``: rank 0 reads the shared files and decides (checkpoint/durable/reads.py: again while the
   storage fails): a weights-only checkpoint.resume becomes model.init_from, model=hf takes its shape from
   the weights, and the problems of checkpoint.resume (a live owner of checkpoint.dir, the checkpoint it
   names or finds, the config it was saved with) and of model.init_from's shape. Every rank applies the same
   config changes, checks the values (the same everywhere) and what it sees itself (data.path, its folders,
   its device); all agree on one block. A refused launch raises the same ConfigError on every rank, marked
   ``agreed`` (train.py prints it once and every rank exits 2); a read that failed for good raises the same
   CheckpointError everywhere (printed once, exit 1).
4. ``claim_lease``: rank 0 takes this attempt's lease on checkpoint.dir (checkpoint/durable/lease.py); every
   rank learns the attempt, or gets the same LiveOwner (exit 2).

The values are checked by trainer/config.py (``value_problems``), the same on every rank.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

import checkpoint.checks
import data.checks
from checkpoint import storage
from checkpoint.durable.lease import LiveOwner, take_lease
from checkpoint.durable.manifest import CheckpointError, CheckpointUnreadable
from checkpoint.durable.preflight import PreflightError
from checkpoint.durable.reads import read_on_rank0
from checkpoint.storage import location
from configs.keys import ConfigError, problems
from model.config import SHAPE_KEYS
from parallel import collectives
from parallel.collectives import agreed
from trainer.config import Config, World, typed, value_problems, warnings

# Set by scripts/torchrun_preemptible.py for its workers once its own check passed (and printed the
# warnings): train.py and trainer/run.py print no warning again.
CONFIG_CHECKED_ENV = "TRAINER_CONFIG_CHECKED"
# scripts/torchrun_preemptible.py's check of an elastic --nnodes=MIN:MAX: the world sizes of the range,
# comma-separated.
CHECK_WORLD_SIZES_ENV = "TRAINER_CHECK_WORLD_SIZES"


def world_size_of(cfg) -> World:
    """The world size train.py will run at: the launcher's WORLD_SIZE, else 1 (plain python); for a dry run
    or a launcher's check_only the layout's product, or None when dp_shard=-1 leaves it open; for the
    launcher's check of an elastic range (CHECK_WORLD_SIZES_ENV) each world size it may form."""
    if cfg.check_only and os.environ.get(CHECK_WORLD_SIZES_ENV, "").strip():
        return tuple(int(n) for n in os.environ[CHECK_WORLD_SIZES_ENV].split(","))
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.dry_run or cfg.check_only:
        p = cfg.parallel
        return p.dp_replicate * p.dp_shard * p.tp if p.dp_shard != -1 else None
    return 1


def refuse(found: Sequence[str]) -> None:
    """Raise the one ConfigError that lists ``found`` (none: nothing)."""
    if found:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(found))


# -- one process: everything at once ---------------------------------------------------------------------
def check(cfg: DictConfig, world_size: World = None, files: bool = False) -> Tuple[Config, List[str]]:
    """The typed config of ``cfg`` (a composed training config) and its warnings (settings that work but
    cannot do what they seem to ask); one ConfigError listing every problem. ``world_size``
    (``world_size_of``): the layout is checked; ``files``: the file probes too (the data, folder and device
    ones not for a dry run). First the config changes the files make (``fill_from_files``)."""
    fill_from_files(cfg)
    config, found = typed(cfg)
    found += value_problems(config, world_size)
    if files:
        data_found, local_found = local_problems(config, found)
        found += data_found + shared_problems(config, found) + local_found
    refuse(list(dict.fromkeys(found)))
    return config, warnings(config, world_size)


def validate_config(cfg: DictConfig, world_size: World = None, files: bool = False) -> List[str]:
    """``check``'s warnings (its ConfigError when refused): what the launchers and tests ask."""
    return check(cfg, world_size, files)[1]


def fill_from_files(cfg: DictConfig) -> None:
    """The config changes the weights make: a weights-only checkpoint.resume becomes model.init_from, then
    model=hf takes its shape from the weights (both read files; under torchrun rank 0 makes them)."""
    checkpoint.checks.weights_only_resume(cfg)  # unit: interop
    if any(OmegaConf.is_missing(cfg.model, k) for k in SHAPE_KEYS):  # unit: interop (model=hf: its code only then)
        from checkpoint.interop.model_shape import fill_model_shape
        fill_model_shape(cfg)


# -- the files -------------------------------------------------------------------------------------------------
def shared_problems(config: Config, found: Sequence[str] = ()) -> List[str]:
    """What the shared files say (checkpoint.resume and model.init_from): read by rank 0 under torchrun. A probe
    that fails is a refusal naming it, not a traceback; nothing is asked of a store whose settings are wrong."""
    if any(f.startswith("checkpoint.s3.") for f in found):
        return []
    storage.configure(config.checkpoint)
    return _probe("checkpoint.resume and model.init_from", lambda: checkpoint.checks.file_problems(config), found)


def local_problems(config: Config, found: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """(data.path's problems, the folders' and the device's) as this rank sees them; none for a dry run but
    the data's. A rank must reach the agreement whatever it found, so a probe that fails is a problem too.
    ``found``: the values' problems (``_probe``)."""
    data_found = _probe("data.path", lambda: data.checks.file_problems(config), found)
    if config.dry_run:
        return data_found, []
    return data_found, _probe("the folders", lambda: folder_problems(config), found) + _probe(
        "the device", lambda: device_problems(config.parallel.device), found)


def _probe(what: str, probe: Callable[[], List[str]], found: Sequence[str] = ()) -> List[str]:
    """``probe()``'s problems; one that raised is a problem naming it, unless the values have problems
    (``found``) and it did not fail on the storage: then it broke on one of those, which are the message."""
    try:
        return probe()
    except ConfigError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - reported in the block
        if found and not isinstance(exc, OSError):
            return []
        return [f"the pre-flight could not finish {what}: {type(exc).__name__}: {exc}"]


def folder_problems(config: Config) -> List[str]:
    """output_root, run_dir, checkpoint.dir and a required memory tier's checkpoint.memory.root: folders this
    process can create and write in (each obstacle once: run_dir under a file output_root is the same problem).
    Nothing is created here; a folder of a store without local files is the lease's to prove (claim_lease)."""
    out, seen = [], set()
    folders = [("output_root", config.output_root), ("run_dir", config.run_dir),
               ("checkpoint.dir", config.checkpoint.dir)]
    if config.checkpoint.memory.folder:  # unit: memory
        folders.append(("checkpoint.memory.root", config.checkpoint.memory.folder))
    for name, path in folders:
        found = folder_problem(name, path)
        if found and found[0] not in seen:
            seen.add(found[0])
            out.append(found[1])
    return out


def folder_problem(name: str, path: str) -> Optional[tuple]:
    """(the obstacle, why) when ``path`` cannot be (or become) a folder this process writes in."""
    local = location(path).local_path()
    if local is None:
        return None
    p = Path(local).absolute()
    for above in [p, *p.parents]:
        if above.exists() or above.is_symlink():
            break
    if not above.is_dir():
        what = "a dangling link" if above.is_symlink() and not above.exists() else "a regular file"
        return above, f"{name}={path}: {above} is {what}, not a folder; point {name} at a folder (or remove {above})"
    if not os.access(above, os.W_OK | os.X_OK):
        where = "the folder" if above == p else f"{above}, where it would be created,"
        why = ("is on a read-only file system" if os.statvfs(above).f_flag & os.ST_RDONLY else
               f"is not writable by this user (uid {os.getuid()})")
        return above, f"{name}={path}: {where} {why}; make it writable or choose another folder"
    return None


def device_problems(device: str, cuda=None) -> List[str]:
    """parallel.device=cuda on a machine without a usable CUDA device; on CUDA (cuda, or auto that picks it),
    more processes on this node (torchrun's LOCAL_WORLD_SIZE, LOCAL_RANK) than devices it sees, where each
    local rank takes device LOCAL_RANK (parallel/init.py). ``cuda``: torch.cuda, or a stand-in (tests).
    torch is imported here, not before: the config checks run without it."""
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


# -- under torchrun ---------------------------------------------------------------------------------------------
def launched_alone() -> bool:
    """No launcher, or a launcher of one process: no process group to agree in."""
    return int(os.environ.get("WORLD_SIZE", "1")) == 1


def check_device(cfg: DictConfig) -> None:
    """Before the process group: the parallel section's values (it reads them) and the device on this host."""
    parallel = OmegaConf.to_object(cfg.parallel)
    refuse(problems(parallel, "parallel") or device_problems(parallel.device))


def check_launch(cfg: DictConfig, world_size: int) -> Tuple[Config, List[str]]:
    """Every check of the launch (see the module docstring), agreed: the typed config (the file's changes
    applied on every rank) and the warnings; raises the agreed ConfigError."""
    rc = cfg.recovery
    try:  # the store's settings before any read that asks it (the same on every rank)  # unit: s3
        refuse(OmegaConf.to_object(cfg.checkpoint.s3).check())
    except ConfigError as exc:
        raise agreed(exc)
    what = "the files of checkpoint.resume and model.init_from"
    try:  # whatever rank 0's reads raised, every rank raises alike (and train.py prints it once)
        changes, shared = read_on_rank0(lambda: _read_shared(cfg), what, rc.read_retries, rc.read_retry_backoff_s,
                                        errors=(ConfigError, CheckpointError))
    except (ConfigError, CheckpointError) as exc:
        raise agreed(exc)
    except OSError as exc:  # an answer that does not change on a second look (a permission refused)
        raise agreed(CheckpointUnreadable(f"{what} could not be read: {exc}. Check that this job may read "
                                          "checkpoint.dir and model.init_from")) from exc
    for name, value in changes.items():
        OmegaConf.update(cfg, name, value, merge=False)
    try:
        config, found = typed(cfg)
    except ConfigError as exc:
        raise agreed(exc)
    found += value_problems(config, world_size)
    seen = collectives.all_gather_object(local_problems(config, found))  # what each rank sees itself
    by_rank = collectives.problems_by_rank
    found += by_rank([s[0] for s in seen]) + shared + by_rank([s[1] for s in seen])
    try:
        refuse(list(dict.fromkeys(found)))
    except ConfigError as exc:
        raise agreed(exc)
    return config, warnings(config, world_size)


def _read_shared(cfg: DictConfig) -> Tuple[Dict, List[str]]:
    """Rank 0's reads: the config changes the weights make (key -> value) and the problems of
    checkpoint.resume and model.init_from. Works on a copy, so a read retried starts afresh."""
    work = copy.deepcopy(cfg)
    fill_from_files(work)
    names = ["checkpoint.resume", *(f"model.{k}" for k in cfg.model)]
    changes = {k: _value(work, k) for k in names if _value(work, k) != _value(cfg, k)}
    config, found = typed(work)
    return changes, shared_problems(config, found + value_problems(config, None))


def _value(cfg: DictConfig, name: str):
    parent, leaf = name.rsplit(".", 1)
    node = OmegaConf.select(cfg, parent)
    if OmegaConf.is_missing(node, leaf):
        return "???"
    value = node[leaf]
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def claim_lease(checkpoint_cfg, lease_root=None) -> int:
    """Rank 0 takes this attempt's lease on checkpoint.dir (at ``lease_root`` when not checkpoint.dir itself: a
    replica group's, checkpoint/durable/lease.py); every rank gets the attempt number, or the same
    LiveOwner (another launch took it first) or PreflightError (checkpoint.dir not writable), agreed."""
    root = location(checkpoint_cfg.dir)

    def take() -> int:
        root.mkdir(parents=True, exist_ok=True)
        return take_lease(root if lease_root is None else lease_root, checkpoint_cfg.lease_timeout_s,
                          checkpoint_cfg.take_over)

    try:
        return collectives.decided_on_rank0(take, errors=(LiveOwner, OSError))
    except LiveOwner as exc:
        raise agreed(exc)
    except OSError as exc:
        raise agreed(PreflightError(f"checkpoint.dir={root} is not writable by this process: {exc}. Make it "
                                    "writable, or point checkpoint.dir at a writable volume")) from exc

