"""Loading a committed checkpoint into a TrainingState, at any world layout.

DCP reshards: each rank asks for the shards its layout needs, and checkpoint/durable/reader.py reads the
bytes straight into them. The manifest and ``.metadata`` are read on rank 0 and broadcast. Verification,
every verdict agreed by all ranks: before anything is touched, ``.metadata``'s checksum and every data
file's size; while loading, rank r checksums the files of saved ranks k with k % world_size == r as it
streams them, so the disk is read once. A failure then leaves the live state partly overwritten: the
caller loads another checkpoint or stops (recovery/resume.py). Damage (CheckpointError) is only what is
proven (manifest.py's inspect_files); the storage failing to deliver is CheckpointUnreadable.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.durable.manifest import (
    LOAD_ERRORS,
    CheckpointError,
    CheckpointUnreadable,
    FileEntry,
    Manifest,
    inspect_files,
    read_manifest,
)
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.writer import RAW
from checkpoint.state.training_state import TrainingState, reseed_rng, rng_key
from checkpoint.storage import location
from parallel import collectives

log = logging.getLogger("trainer")


def _agree(path: Path, found: Tuple[List[str], List[str]], what: str) -> None:
    """Raise the same error on every rank if any rank found (damage, unreadable) problems: damage
    wins (CheckpointError), else CheckpointUnreadable. Each message names the rank that saw it."""
    damage, unreadable = found
    for p in damage + unreadable:
        log.error("checkpoint %s: %s", path, p)
    everyone = collectives.all_gather_object((damage, unreadable)) if collectives.any_rank(
        bool(damage or unreadable)) else []
    seen_damage = [f"rank {r}: {p}" for r, (d, _) in enumerate(everyone) for p in d]
    seen_unreadable = [f"rank {r}: {p}" for r, (_, u) in enumerate(everyone) for p in u]
    if seen_damage:
        raise CheckpointError(f"{path} failed verification{what}: {'; '.join(seen_damage)}")
    if seen_unreadable:
        raise CheckpointUnreadable(f"{path} could not be read{what}: {'; '.join(seen_unreadable)}")


def read_metadata(reader: "RawFileReader") -> Metadata:
    """``.metadata`` of a checkpoint: CheckpointUnreadable for an I/O error, CheckpointError if it does not load."""
    try:
        return reader.read_metadata()
    except OSError as exc:
        raise CheckpointUnreadable(f"{reader.path}: .metadata: {exc}") from exc
    except Exception as exc:  # checksummed up front when verifying: a bad unpickle is damage
        raise CheckpointError(f"{reader.path}: .metadata does not load ({type(exc).__name__}: {exc})") from exc


def _saved_rank(name: str) -> int | None:
    m = re.match(r"__(\d+)_\d+\.distcp$", name)
    return int(m.group(1)) if m else None


def verification_shares(manifest: Manifest, rank: int, world_size: int) -> Tuple[List[str], Dict[str, FileEntry]]:
    """(other files this rank checks up front, data files it checksums while loading)."""
    saved = {n: _saved_rank(n) for n in manifest.files}
    data = {n: manifest.files[n] for n, k in saved.items() if k is not None and k % world_size == rank}
    others = sorted(n for n, k in saved.items() if k is None)[rank::world_size]
    return others, data


def _all_raw(meta: Metadata) -> bool:
    """True when every tensor was written by checkpoint/durable/writer.py (else: stock DCP's format)."""
    return all(list(info.transform_descriptors or ()) == [RAW] for idx, info in meta.storage_data.items()
               if isinstance(meta.state_dict_metadata[idx.fqn], TensorStorageMetadata))


def _has(keys: List[str], component: str) -> bool:
    return any(k == component or k.startswith(component + ".") for k in keys)


def load_checkpoint(state: TrainingState, path: Path, *, seed: int, verify: bool = True, threads: int = 2,
                    process_group=None, manifest: Optional[Manifest] = None,
                    fault: Optional[Callable[[Path], None]] = None) -> Manifest:
    """Verify ``path`` and restore ``state`` from it; returns the manifest (``manifest``: already
    read and agreed by the caller). ``fault(file)`` is called before each data file is read."""
    path = location(path)
    if manifest is None:
        manifest = collectives.decided_on_rank0(lambda: read_manifest(path), errors=LOAD_ERRORS)
    checksums = manifest.checksum_algorithm is not None
    others, data = verification_shares(manifest, state.rank, state.world_size)
    if verify:  # before anything is touched: .metadata completely, data files by size
        first, sizes = (inspect_files(path, manifest, others, checksums=checksums),
                        inspect_files(path, manifest, sorted(data), checksums=False))
        _agree(path, (first[0] + sizes[0], first[1] + sizes[1]), "")
    reader = RawFileReader(path, algorithm=manifest.checksum_algorithm, threads=threads, fault=fault)
    reader._metadata = collectives.decided_on_rank0(lambda: read_metadata(reader), errors=LOAD_ERRORS)
    meta = reader.read_metadata()
    if verify and _all_raw(meta):
        reader.verify = data  # checksummed while reading
    elif verify:  # stock DCP's format deserialises: check the bytes before it does
        _agree(path, inspect_files(path, manifest, sorted(data), checksums=checksums), "")
    keys = list(meta.state_dict_metadata)
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
        if component == "guards":  # saved before the guards were part of the state: they warm up again
            sd.pop("guards")
            log.warning("the checkpoint has no guard statistics (saved by an older version): the guards "
                        "warm up again, so alarms may differ from an uninterrupted run")
            continue
        if component == "torchft":  # saved without parallel.fault_tolerance: torchft starts at the checkpoint's step
            sd.pop("torchft")
            continue
        raise CheckpointError(f"{path} has no '{component}' state (it holds: "
                              f"{sorted({k.split('.')[0] for k in keys})}); it was saved by a run without it")
    dcp.load(sd, storage_reader=reader, process_group=process_group, no_dist=not collectives.distributed())
    _agree(path, (reader.problems, reader.unreadable), " while loading (the live training state is now partly "
           "overwritten: load another checkpoint before training)")
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
