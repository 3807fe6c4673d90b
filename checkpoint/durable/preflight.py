"""Before step 1: can the checkpoint directory take the saves this run will make?

It exists (or can be created), this process can write and fsync a file there, and it has room for the
checkpoints the run holds at its peak: retention deletes only after a new save commits, so while one is
written the directory holds keep_last + 1. Committed checkpoints already there count as held, leftovers of
interrupted saves as free (resume removes them). One checkpoint's size is the newest manifest's, else the
estimate from the model. Short of room, the run stops here (``checkpoint.on_save_error=stop``), before it
trains up to a save that cannot succeed; with ``continue`` it warns.

``checkpoint.async_mode=async_process`` stages each rank's state in shared memory (checkpoint/durable/staging.py),
which lives in /dev/shm: the node needs room there for every local rank's copy, or the first save dies of
SIGBUS. That is checked here too (``shared_staging_problem``), whatever ``on_save_error`` says.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from checkpoint.durable.discovery import Listing
from checkpoint.durable.manifest import CheckpointUnreadable
from checkpoint.durable.reads import READ_RETRIES, READ_RETRY_BACKOFF_S, read_on_rank0
from checkpoint.storage import location

log = logging.getLogger("trainer")

MARGIN = 1.05  # the manifest, acknowledgements and file-system overhead on top of the data files
SHM = Path("/dev/shm")  # where torch's shared memory lives (shm_open)


class PreflightError(RuntimeError):
    """The checkpoint directory cannot hold the run's checkpoints; the message names the path and numbers."""


def expected_checkpoint_bytes(model: torch.nn.Module, optimizer_states: int = 2, ema: bool = False,
                              local: bool = False) -> int:
    """Global size of model + AdamW moments (+ EMA); ``numel`` of a DTensor is its global size. ``local``: this
    rank's part, its shards (what it stages for a save; a replica rank of HSDP holds one too)."""
    params = sum((p.to_local() if local and hasattr(p, "to_local") else p).numel() * p.element_size()
                 for p in model.parameters())
    return params * (1 + optimizer_states + (1 if ema else 0))


def shared_staging_problem(rank_bytes: int, local_ranks: int, shm: Optional[Path] = None) -> Optional[str]:
    """The problem when /dev/shm (``shm``) has no room for ``local_ranks`` staging copies of ``rank_bytes``
    (``async_process``), else None."""
    shm, need = shm or SHM, rank_bytes * local_ranks
    try:
        usage = shutil.disk_usage(shm)
    except OSError as exc:
        return f"checkpoint.async_mode=async_process stages in shared memory, but {shm} cannot be read: {exc}"
    if usage.free >= need:
        return None
    return (f"checkpoint.async_mode=async_process stages each rank's state in shared memory: {local_ranks} "
            f"rank{'s' if local_ranks > 1 else ''} on this node x {rank_bytes:,} bytes = {need:,} bytes "
            f"({_gib(need)}), but {shm} has {usage.free:,} bytes ({_gib(usage.free)}) free of {usage.total:,}; "
            "the first save would die of SIGBUS. Enlarge it (docker run --shm-size, or mount -o remount,size=... "
            "/dev/shm), or set checkpoint.async_mode=async (the writer thread stages in ordinary memory)")


@dataclass(frozen=True)
class Room:
    """What the directory holds and needs. ``checkpoint_bytes``: one checkpoint, from ``source``."""

    free: int  # free bytes now, plus leftovers that resume removes
    checkpoint_bytes: int
    source: str  # where checkpoint_bytes comes from (the newest manifest, or the model's size)
    committed: int  # committed checkpoints already in the directory
    keep_last: int

    @property
    def to_write(self) -> int:
        """Checkpoints still to fit before retention starts deleting (at least the next one)."""
        return max(1, self.keep_last + 1 - self.committed)

    @property
    def needed(self) -> int:
        return int(self.to_write * self.checkpoint_bytes * MARGIN)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


@dataclass(frozen=True)
class Held:
    """What the directory holds already. It takes a listing and a read of every manifest, so a job
    reads it once, on rank 0, and gives it to every rank (checkpoint/manager.py)."""

    checkpoint_bytes: int  # one checkpoint: the newest manifest's size, else the estimate
    source: str
    committed: int
    leftover: int  # bytes of interrupted saves (resume removes them)


def held_in(root: Path, estimate_bytes: int) -> Held:
    """List ``root``: the size of one checkpoint (the newest manifest's, else ``estimate_bytes``),
    the committed checkpoints and the leftovers."""
    listing = Listing(root)
    committed = listing.committed(include_bad=True, include_superseded=True)
    newest = next((c for c in committed if c.manifest is not None and c.manifest.total_bytes > 0), None)
    size, source = ((newest.manifest.total_bytes, f"the size in {newest.checkpoint_id}'s manifest") if newest
                    else (estimate_bytes, "estimated from the model: no committed checkpoint yet"))
    leftover = sum(e.size for c in listing.checkpoints() if not c.committed for e in c.path.walk())
    return Held(size, source, len(committed), leftover)


def held_once(root: Path, estimate_bytes: int, retries: int = READ_RETRIES,
              backoff_s: float = READ_RETRY_BACKOFF_S) -> Held:
    """``held_in`` read on rank 0 (again while the storage fails) and given to every rank (a
    collective: every rank calls it)."""
    try:
        return read_on_rank0(lambda: held_in(root, estimate_bytes), f"checkpoint.dir={root}", retries, backoff_s)
    except (OSError, CheckpointUnreadable) as exc:  # raised on every rank alike
        raise PreflightError(f"checkpoint.dir={root} cannot be listed: {exc}") from exc


def room_for(root: Path, estimate_bytes: int, keep_last: int, held: Optional[Held] = None) -> Room:
    """The room ``root`` has (this process's view of its file system) for what it holds (``held``,
    listed here when not given)."""
    held = held if held is not None else held_in(root, estimate_bytes)
    free = location(root).free_bytes()
    free = float("inf") if free is None else free + held.leftover  # an object store has no free-space number
    return Room(free, held.checkpoint_bytes, held.source, held.committed, keep_last)


def not_a_folder(root) -> Optional[str]:
    """The message when ``root`` (or a folder above it) is a file, not a folder (None otherwise)."""
    local = location(root).local_path()
    for above in [Path(local), *Path(local).parents] if local is not None else []:
        if above.exists():
            return None if above.is_dir() else (f"checkpoint.dir={root}: {above} is a regular file, not a folder; "
                                                "point checkpoint.dir at a folder")
    return None


def preflight_checkpoint_dir(root: Path, expected_bytes: int, keep_last: int, rank: int,
                             strict: bool = True, held: Optional[Held] = None) -> Optional[Room]:
    """Raise PreflightError if ``root`` cannot take this run's checkpoints (``strict``; else a
    warning for lack of room). Returns what was measured. ``held``: what rank 0 listed there."""
    root = location(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreflightError(not_a_folder(root) or f"checkpoint.dir={root} does not exist and cannot be created: "
                             f"{exc}") from exc
    probe = root / f".preflight-rank{rank}-{os.getpid()}"
    try:
        with probe.open("wb") as f:  # durable when closed: a disk that cannot fsync fails here
            f.write(b"x" * 4096)
    except OSError as exc:
        raise PreflightError(f"checkpoint.dir={root} is not writable by this process: {exc}. Make it writable, "
                             "or point checkpoint.dir at a writable volume") from exc
    finally:
        probe.unlink(missing_ok=True)
    room = room_for(root, expected_bytes, keep_last, held)
    if room.free >= room.needed:
        return room
    message = (f"checkpoint.dir={root} has {room.free:,} bytes ({_gib(room.free)}) free, counting leftovers of "
               f"interrupted saves, but this run needs {room.needed:,} bytes ({_gib(room.needed)}): "
               f"{room.to_write} more checkpoint(s) of {room.checkpoint_bytes:,} bytes ({room.source}), because "
               f"while a save is written the directory holds checkpoint.keep_last + 1 = {keep_last + 1} and "
               f"{room.committed} committed checkpoint(s) are there already. Free space there, point "
               "checkpoint.dir at a larger volume, or lower checkpoint.keep_last; "
               "checkpoint.on_save_error=continue trains anyway (a save that fails is an alarm)")
    if strict:
        raise PreflightError(message)
    if rank == 0:
        log.warning("%s", message)
    return room
