"""Which committed checkpoints to keep: a pure policy, and its application off the training thread.

Tiers: ``rolling`` (the newest keep_last), ``permanent`` (step divisible by keep_every),
``best`` (the keep_best lowest values of ``checkpoint.best_metric``, a manifest field: ``loss``,
``probe_loss`` or ``val_loss``; a checkpoint without a value is never best), and ``verified``: the
newest checkpoint saved with no guard alarm before it is always kept, for rollback. The newest
committed checkpoint is always kept. Only committed checkpoints that are neither BAD nor superseded
are considered: an in-flight save never counts as kept, and retention only runs after a newer commit.

Forensics: BAD and superseded checkpoints (checkpoint/durable/discovery.py) and older saves of a
step (revisions another save of the step replaced) are not in the tiers; the newest ``keep_forensic`` of them
(by step) stay for people, the rest are deleted, so a run that keeps hitting damage does not keep
a terabyte per incident.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from checkpoint.durable.discovery import list_checkpoints, remove_checkpoint
from checkpoint.durable.layout import MANIFEST, parse
from checkpoint.durable.manifest import CheckpointUnreadable
from checkpoint.storage import location

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
    if newest_verified is not None and not tiers[newest_verified.step]:
        tiers[newest_verified.step].append("verified")  # what a rollback goes back to
    return tiers


def delete_checkpoint(path, fault_hook=None) -> None:
    """The manifest first (uncommitted from then on, so a half-deleted folder never looks committed), then
    the rest."""
    path = location(path)
    (path / MANIFEST).unlink(missing_ok=True)
    if fault_hook is not None:  # recovery's fault injection: a crash mid-deletion
        fault_hook("checkpoint_retention", parse(path.name)[0])
    remove_checkpoint(path)


def forensic_plan(names: Sequence[str], keep: int) -> List[str]:
    """Of the BAD, superseded and replaced folders ``names``, the ones to delete: all but the newest
    ``keep`` by step (among saves of one step, the later revision first)."""
    return sorted(names, key=parse, reverse=True)[max(keep, 0):]


def apply_retention(root, keep_last: int, keep_every: int, keep_best: int, best_metric: str,
                    fault_hook=None, keep_forensic: int = 1) -> List[str]:
    """Delete what the plan drops among the committed, not-bad, not-superseded checkpoints, and
    the forensic directories past ``keep_forensic``; returns their names."""
    listed = list_checkpoints(root)  # one listing: the plan and the forensic count see the same folders
    committed = [c for c in listed if c.committed and not c.replaced and c.bad is None and c.superseded is None]
    unread = [c.unreadable for c in committed if c.manifest is None]
    if unread:  # its tier and verified flag are unknown: delete nothing on a guess (the next commit retries)
        raise CheckpointUnreadable(f"retention needs every manifest; the storage did not deliver: {'; '.join(unread)}")
    cands = [Candidate(c.step, getattr(c.manifest, best_metric, None), c.manifest.verified) for c in committed]
    plan = retention_plan(cands, keep_last, keep_every, keep_best)
    deleted = []
    for c in committed:
        if not plan[c.step]:
            delete_checkpoint(c.path, fault_hook)
            deleted.append(c.checkpoint_id)
    forensic = [c.path for c in listed if c.committed and (c.bad or c.superseded or c.replaced)]
    by_name = {p.name: p for p in forensic}
    for name in forensic_plan(list(by_name), keep_forensic):
        delete_checkpoint(by_name[name], fault_hook)
        deleted.append(name)
    if deleted:
        log.info("retention removed %s", ", ".join(deleted))
    return deleted
