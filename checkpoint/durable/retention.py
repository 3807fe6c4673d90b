"""Which committed checkpoints to keep: a pure policy, and its application off the training thread.

Tiers: ``rolling`` (the newest keep_last), ``permanent`` (step divisible by keep_every),
``best`` (the keep_best lowest values of ``checkpoint.best_metric``, a manifest field: ``loss``,
``probe_loss`` or ``val_loss``; a checkpoint without a value is never best), and ``verified``: when every
kept checkpoint was saved after a guard alarm, the newest clean one stays for rollback. The
newest committed checkpoint is always kept. Only committed checkpoints are considered: an in-flight save
never counts as kept, and retention only runs after a newer commit.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from checkpoint.durable.integrity import fsync_dir
from checkpoint.durable.layout import DELETING

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Candidate:
    step: int
    metric: Optional[float] = None  # lower is better; None never ranks as best
    verified: bool = True  # False: saved after a guard alarm (recovery/guards)


def retention_plan(candidates: Sequence[Candidate], keep_last: int, keep_every: int = 0,
                   keep_best: int = 0) -> Dict[int, List[str]]:
    """{step: tiers} for every candidate; an empty list means delete it."""
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={keep_last} must be >= 1")
    by_step = sorted({c.step: c for c in candidates}.values(), key=lambda c: c.step, reverse=True)
    tiers: Dict[int, List[str]] = {c.step: [] for c in by_step}
    for c in by_step[:keep_last]:
        tiers[c.step].append("rolling")
    if keep_every > 0:
        for c in by_step:
            if c.step % keep_every == 0:
                tiers[c.step].append("permanent")
    if keep_best > 0:
        scored = sorted((c for c in by_step if c.metric is not None), key=lambda c: (c.metric, -c.step))
        for c in scored[:keep_best]:
            tiers[c.step].append("best")
    if by_step and "rolling" not in tiers[by_step[0].step]:  # cannot happen with keep_last >= 1
        tiers[by_step[0].step].append("rolling")
    newest_verified = next((c for c in by_step if c.verified), None)
    if newest_verified is not None and not any(tiers[c.step] for c in by_step if c.verified):
        # Every kept checkpoint was saved after a guard alarm: keep the last clean one to roll back to.
        tiers[newest_verified.step].append("verified")
    return tiers


def delete_checkpoint(path: Path, fault_hook=None) -> None:
    """Rename out of the committed namespace first, so a half-deleted directory never looks committed."""
    path = Path(path)
    doomed = path.with_name(path.name + DELETING)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    if fault_hook is not None:  # recovery's fault injection: a crash mid-deletion
        fault_hook("checkpoint_retention", int(path.name.split("_")[-1]))
    shutil.rmtree(doomed)


def apply_retention(root: Path, keep_last: int, keep_every: int, keep_best: int, best_metric: str,
                    fault_hook=None) -> List[str]:
    """Delete what the plan drops among the committed, not-bad checkpoints; returns their ids."""
    from checkpoint.durable.discovery import list_committed

    committed = list_committed(root)
    cands = [Candidate(c.step, getattr(c.manifest, best_metric, None), c.manifest.verified) for c in committed]
    plan = retention_plan(cands, keep_last, keep_every, keep_best)
    deleted = []
    for c in committed:
        if not plan[c.step]:
            delete_checkpoint(c.path, fault_hook)
            deleted.append(c.checkpoint_id)
    if deleted:
        log.info("retention removed %s", ", ".join(deleted))
    return deleted
