"""The checks of a launch, made once and agreed by every rank, before anything is built or written.

Under torchrun every rank starts from the same config but not from the same view of the files: a
read that fails on one rank (EIO, a stale handle), or an answer that depends on the host (is the
lease's owner a dead process here?), would send that rank another way than its peers, and 512
ranks would read the same manifests. So trainer/run.py checks a launch in this order:

1. ``check_device``: what starting the process group needs (parallel.device, the collective
   timeout), on each host. A lone process (no launcher) runs step 3 here instead, whole.
2. The process group starts (parallel/init.py).
3. ``check_launch``: rank 0 reads the shared files and decides (checkpoint/durable/reads.py:
   again while the storage fails): a weights-only checkpoint.resume becomes model.init_from,
   model=hf takes its shape from the weights, and the problems of checkpoint.resume (a live owner
   of checkpoint.dir, the checkpoint it names or finds, the config it was saved with) and of
   model.init_from's shape. Every rank applies the same config changes, checks the values (the
   same everywhere) and what it sees itself (data.path, its folders); all agree on one block. A
   refused launch raises the same ConfigError on every rank, marked ``agreed`` (train.py prints
   it once and every rank exits 2); a read that failed for good raises the same CheckpointError
   everywhere (printed once, exit 1), before the model, the optimizer or the data exist and before
   anything is written into the run directory.
4. ``claim_lease``: rank 0 takes this attempt's lease on checkpoint.dir (checkpoint/durable/
   lease.py); every rank learns the attempt, or gets the same LiveOwner (exit 2). Of two launches
   at once, one gets the lease and the other is refused here, having built nothing.
"""

from __future__ import annotations

import copy
import os
from typing import Dict, List, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

import checkpoint.checks
import data.checks
from checkpoint import storage
from checkpoint.durable.lease import LiveOwner, take_lease
from checkpoint.durable.manifest import CheckpointError, CheckpointUnreadable
from checkpoint.durable.preflight import PreflightError
from checkpoint.durable.reads import read_on_rank0
from checkpoint.storage import location
from configs.checks import ConfigError, Problems
from configs.constants import DEVICES
from parallel import collectives
from parallel.collectives import agreed
from trainer.checks import device_problems, fill_from_files, folder_problems, refuse, value_problems

MISSING = "???"  # a key the config leaves unset (configs/model/hf.yaml's shape)


def launched_alone() -> bool:
    """No launcher, or a launcher of one process: no process group to agree in."""
    return int(os.environ.get("WORLD_SIZE", "1")) == 1


def check_device(cfg: DictConfig) -> None:
    """Before the process group: the values starting it reads, and the device on this host."""
    p, problems = cfg.parallel, Problems()
    problems.choice("parallel.device", p.device, DEVICES)
    problems.positive("parallel.collective_timeout_s", p.collective_timeout_s)
    if not problems:
        problems += device_problems(cfg)
    refuse(problems)


def check_launch(cfg: DictConfig, world_size: int) -> List[str]:
    """Every check of the launch (see the module docstring), agreed; applies the config changes the
    files make to ``cfg`` on every rank. Returns the warnings; raises the agreed ConfigError."""
    rc = cfg.recovery
    try:  # the store's settings before any read that asks it (the same values on every rank)
        refuse(storage.setting_problems(cfg.checkpoint))
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
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False)
    problems = value_problems(cfg, world_size)
    seen = collectives.all_gather_object(_local_problems(cfg))  # what each rank sees itself
    by_rank = collectives.problems_by_rank
    problems += by_rank([s[0] for s in seen]) + shared + by_rank([s[1] for s in seen])
    try:
        refuse(problems)
    except ConfigError as exc:
        raise agreed(exc)
    return checkpoint.checks.config_warnings(cfg)


def _read_shared(cfg: DictConfig) -> Tuple[Dict, List[str]]:
    """Rank 0's reads: the config changes the weights make (key -> value) and the problems of
    checkpoint.resume and model.init_from. Works on a copy, so a read retried starts afresh."""
    work = copy.deepcopy(cfg)
    fill_from_files(work)
    keys = ["checkpoint.resume", *(f"model.{k}" for k in cfg.model)]
    changes = {k: _value(work, k) for k in keys if _value(work, k) != _value(cfg, k)}
    return changes, checkpoint.checks.file_problems(work)


def _value(cfg: DictConfig, key: str):
    parent, leaf = key.rsplit(".", 1)
    node = OmegaConf.select(cfg, parent)
    if OmegaConf.is_missing(node, leaf):
        return MISSING
    value = node[leaf]
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _local_problems(cfg: DictConfig) -> Tuple[List[str], List[str]]:
    """(data.path's problems, the folders' and the device's) as this rank sees them. A check that
    fails here is a problem too: a rank must reach the agreement whatever it found."""
    found = []
    for check in (lambda: data.checks.file_problems(cfg), lambda: folder_problems(cfg) + device_problems(cfg)):
        try:
            found.append(check())
        except Exception as exc:  # noqa: BLE001 - any failure is reported in the agreed block
            found.append([f"the start-up check failed on this rank: {type(exc).__name__}: {exc}"])
    return found[0], found[1]


def claim_lease(cfg: DictConfig) -> int:
    """Rank 0 takes this attempt's lease on checkpoint.dir; every rank gets the attempt number, or the
    same LiveOwner (another launch took it first) or PreflightError (checkpoint.dir not writable),
    marked ``agreed``."""
    c = cfg.checkpoint
    root = location(c.dir)

    def take() -> int:
        root.mkdir(parents=True, exist_ok=True)
        return take_lease(root, c.lease_timeout_s, c.take_over)

    try:
        return collectives.decided_on_rank0(take, errors=(LiveOwner, OSError))
    except LiveOwner as exc:
        raise agreed(exc)
    except OSError as exc:
        raise agreed(PreflightError(f"checkpoint.dir={root} is not writable by this process: {exc}. Make it "
                                    "writable, or point checkpoint.dir at a writable volume")) from exc
