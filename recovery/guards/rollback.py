"""Rollback after an alarm: restore the newest *verified* checkpoint, skip the bad data window
(docs/guards.md, "Rollback").

The target is a committed, not-bad checkpoint whose manifest says ``verified`` (no guard alarm since
the previous save), before the alarm; at least ``rollback_min_age_steps`` before it (corruption can be
older than its detection), from the permanent (keep_every) tier first with ``rollback_prefer_permanent``.
After loading, the data position jumps past the steps since the target, so a poisonous batch is not fed
again. The committed checkpoints after the target are marked superseded and the target is saved again
with the data skip, so a crash after the rollback continues the new trajectory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from checkpoint.durable.discovery import Listing, parse
from checkpoint.storage import location
from recovery.resume import load_with_fallback, supersede

log = logging.getLogger("trainer")


class RollbackRequested(RuntimeError):
    """Raised at a step boundary: restore the newest verified checkpoint and skip ahead."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"rollback requested at step {step}: {reason}")
        self.step = step
        self.reason = reason


@dataclass(frozen=True)
class RollbackCandidate:
    step: int
    verified: bool
    path: str


def choose_rollback_target(candidates: Sequence[RollbackCandidate], alarm_step: int, min_age_steps: int = 0,
                           keep_every: int = 0, prefer_permanent: bool = True) -> Optional[RollbackCandidate]:
    """Newest verified checkpoint at least ``min_age_steps`` before the alarm (permanent tier first)."""
    old_enough = [c for c in candidates if c.verified and c.step < alarm_step and c.step <= alarm_step - min_age_steps]
    clean = sorted(old_enough, key=lambda c: c.step, reverse=True)
    if prefer_permanent and min_age_steps > 0 and keep_every > 0:
        permanent = [c for c in clean if c.step % keep_every == 0]
        if permanent:
            return permanent[0]
    return clean[0] if clean else None


class RollbackError(RuntimeError):
    """No clean checkpoint to roll back to, or too many rollbacks: a person must look."""


def roll_back(request: RollbackRequested, guards, ckpt, data,
              after_load: Optional[Callable[[int], None]] = None) -> int:
    """Load the chosen checkpoint into the live training state and move the data past the bad
    window; returns the step to continue from. A target that fails to load is marked bad (or,
    unreadable, skipped) and the next older choice is loaded (recovery/resume.py's fallback).
    ``after_load(step)`` runs once the target is loaded, before it is saved again (replica groups:
    torchft's step follows the training state's, recovery/fault_tolerance.py)."""
    gcfg = guards.cfg
    if guards.rollbacks >= gcfg.max_rollbacks:
        raise RollbackError(
            f"{request}; already rolled back {guards.rollbacks} times in this process "
            f"(recovery.guards.max_rollbacks={gcfg.max_rollbacks}): stopping instead of looping. "
            f"Inspect the alarms in {guards.alarms_dir}")
    guards.rollbacks += 1
    ckpt.wait()  # an in-flight save must commit (or fail) before we choose ...
    ckpt.wait_for_retention()  # ... and retention must not be renaming the one we choose

    listing = Listing(ckpt.root)  # rank 0's, for the target, each fallback and the supersede marks

    def target(below: Optional[int] = None) -> Optional[Path]:
        found = [RollbackCandidate(c.step, c.manifest is not None and c.manifest.verified, str(c.path))
                 for c in listing.committed()  # a manifest not read this time: not known to be verified
                 if below is None or c.step < below]  # below: older than one that failed (BAD or unreadable)
        chosen = choose_rollback_target(found, request.step, gcfg.rollback_min_age_steps,
                                        ckpt.cfg.keep_every, gcfg.rollback_prefer_permanent)
        return location(chosen.path) if chosen else None

    loaded = load_with_fallback(ckpt, target, lambda failed: target(below=parse(failed.name)[0]))
    if loaded is None:
        raise RollbackError(
            f"{request}, but {ckpt.root} holds no verified checkpoint before step {request.step}"
            + (f" and at least {gcfg.rollback_min_age_steps} steps older" if gcfg.rollback_min_age_steps else "")
            + ". Restart from a known-good checkpoint with checkpoint.resume=<path>.")
    manifest = loaded[0]
    if after_load is not None:
        after_load(manifest.step)
    ckpt.discard_memory()  # the memory tier's snapshots hold the trajectory just abandoned
    # so do the committed checkpoints after the target: a crash must not resume them
    supersede(ckpt, manifest.step, f"abandoned by the rollback from step {request.step} to step {manifest.step} "
                                   f"({request.reason})", listing)
    skipped = (request.step - manifest.step) * ckpt.global_batch_size
    data.skip_samples(skipped)
    guards.after_rollback()
    # The data skip and the clean guard state exist only in memory: save them over the target, and
    # wait, so a crash from here on resumes this trajectory, not the one before the rollback.
    ckpt.save(manifest.step, manifest.loss)
    ckpt.wait()
    log.warning("rolled back from step %d to verified checkpoint %s (step %d); skipping %d samples (the "
                "data of steps %d..%d)", request.step, manifest.checkpoint_id, manifest.step, skipped,
                manifest.step + 1, request.step)
    ckpt.log_event(request.step, kind="rollback", to_step=manifest.step, checkpoint_id=manifest.checkpoint_id,
                   skipped_samples=skipped, reason=request.reason)
    return manifest.step
