"""Loading a committed checkpoint into a TrainingState, at any world layout.

DCP reshards on load: each rank asks for the shards its current layout needs (model,
optimizer and EMA tensors are DTensors or plain tensors; DCP maps saved chunks to them).
Files are verified against the manifest first (size and checksum; each rank checks a share
of the files and all ranks agree on the verdict).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from checkpoint.manifest import CheckpointError, Manifest, check_files, read_manifest
from checkpoint.rng import reseed_rng
from checkpoint.state import TrainingState, rng_key

log = logging.getLogger("trainer")


def any_rank(flag: bool, device: torch.device = torch.device("cpu")) -> bool:
    """True on every rank if ``flag`` is true on any rank (False without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def verify_files(path: Path, manifest: Manifest, rank: int, world_size: int, checksums: bool,
                 device: torch.device = torch.device("cpu")) -> None:
    """Every rank checks files i with i % world_size == rank; all raise if any file is bad."""
    names = sorted(manifest.files)[rank::world_size]
    problems = check_files(path, manifest, names, checksums=checksums)
    for p in problems:
        log.error("checkpoint %s: %s", path, p)
    if any_rank(bool(problems), device):
        raise CheckpointError(f"{path} failed verification" + (f": {'; '.join(problems)}" if problems else
                                                                " on another rank (see its log)"))


def saved_keys(path: Path) -> List[str]:
    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _has(keys: List[str], component: str) -> bool:
    return any(k == component or k.startswith(component + ".") for k in keys)


def load_checkpoint(state: TrainingState, path: Path, *, seed: int, verify: bool = True,
                    process_group=None, device: torch.device = torch.device("cpu")) -> Manifest:
    """Verify ``path`` and restore ``state`` from it; returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest, state.rank, state.world_size, checksums=manifest.checksum_algorithm is not None,
                     device=device)
    keys = saved_keys(path)
    sd = state.state_dict()
    same_world = manifest.world_size == state.world_size
    rng_saved = _has(keys, f"rng.{rng_key(state.rank)}")
    if not (same_world and rng_saved):
        sd.pop("rng", None)
    reinit_ema = False
    for component in list(sd):
        if component == "rng" or _has(keys, component):
            continue
        if component == "ema":  # EMA turned on at resume (the config change was allowed): start from weights
            sd.pop("ema")
            reinit_ema = True
            continue
        raise CheckpointError(f"{path} has no '{component}' state (it holds: "
                              f"{sorted({k.split('.')[0] for k in keys})}); it was saved by a run without it")
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(sd, checkpoint_id=str(path), process_group=process_group, no_dist=no_dist)
    state.load_state_dict(sd)
    if reinit_ema:
        log.warning("the checkpoint has no EMA weights: EMA starts from the loaded weights")
        state.ema.load_state_dict({n: p.detach() for n, p in state.ema.params.items()})
    if not (same_world and rng_saved):
        reseed_rng(seed, state.step, state.rank)
        log.warning("RNG: the checkpoint was saved at world size %d, this run has %d: every rank reseeds "
                    "python/numpy/torch from (seed, step, rank)", manifest.world_size, state.world_size)
    if state.step != manifest.step:
        raise CheckpointError(f"{path}: restored step {state.step} but the manifest says {manifest.step}")
    return manifest
