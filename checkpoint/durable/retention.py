"""Which committed checkpoints to keep: a pure policy, and its application off the training thread.

Tiers: ``rolling`` (the newest keep_last), ``permanent`` (step divisible by keep_every),
``best`` (the keep_best lowest values of ``checkpoint.best_metric``, a manifest field: ``loss``,
``probe_loss`` or ``val_loss``; a checkpoint without a value is never best), and ``verified``: the
newest checkpoint saved with no guard alarm before it is always kept, for rollback. The newest
committed checkpoint is always kept. Only committed checkpoints that are neither BAD nor superseded
are considered: an in-flight save never counts as kept, and retention only runs after a newer commit.

Forensics: BAD and superseded checkpoints (checkpoint/durable/discovery.py) and older saves of a
step moved aside (``.replaced-<ns>``) are not in the tiers; the newest ``keep_forensic`` of them
(by step) stay for people, the rest are deleted, so a run that keeps hitting damage does not keep
a terabyte per incident.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from checkpoint.durable.integrity import fsync_dir
from checkpoint.durable.layout import DELETING, MANIFEST, REPLACED, parse
from checkpoint.durable.location import location, on_object_store, remove_tree
from checkpoint.durable.manifest import CheckpointUnreadable

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


def delete_checkpoint(path: Path, fault_hook=None) -> None:
    """Rename out of the committed namespace first, so a half-deleted directory never looks committed."""
    path = location(path)
    if on_object_store(path):  # no rename: the manifest goes first (uncommitted from then on), then the rest
        (path / MANIFEST).unlink(missing_ok=True)
        if fault_hook is not None:
            fault_hook("checkpoint_retention", parse(path.name)[0])
        remove_tree(path)
        return
    doomed = path.with_name(path.name + DELETING)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    if fault_hook is not None:  # recovery's fault injection: a crash mid-deletion
        fault_hook("checkpoint_retention", parse(path.name)[0])
    shutil.rmtree(doomed)


def forensic_plan(names: Sequence[str], keep: int) -> List[str]:
    """Of the BAD, superseded and replaced directories ``names``, the ones to delete: all but the
    newest ``keep`` by step (a replaced one by its time of replacement among the same step)."""
    def order(name: str):  # newest first: by step, then the one in place, then the latest replaced
        step, suffix = parse(name)
        moved = suffix[len(REPLACED):] if suffix.startswith(REPLACED) else ""
        return step, int(moved) if moved.isdigit() else (0 if moved else float("inf"))

    return sorted(names, key=order, reverse=True)[max(keep, 0):]


def apply_retention(root: Path, keep_last: int, keep_every: int, keep_best: int, best_metric: str,
                    fault_hook=None, keep_forensic: int = 1) -> List[str]:
    """Delete what the plan drops among the committed, not-bad, not-superseded checkpoints, and
    the forensic directories past ``keep_forensic``; returns their names."""
    from checkpoint.durable.discovery import list_checkpoints, list_committed

    committed = list_committed(root)
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
    forensic = [c.path for c in list_checkpoints(root) if (c.committed and (c.bad or c.superseded))
                or parse(c.checkpoint_id)[1].startswith(REPLACED)]
    by_name = {p.name: p for p in forensic}
    for name in forensic_plan(list(by_name), keep_forensic):
        delete_checkpoint(by_name[name], fault_hook)
        deleted.append(name)
    if deleted:
        log.info("retention removed %s", ", ".join(deleted))
    return deleted
