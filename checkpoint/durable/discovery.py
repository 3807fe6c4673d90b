"""checkpoint.dir: its names, the checkpoints it holds, the resume choice, marks, retention, leftovers.

A checkpoint is a folder ``step_<N>`` (or ``step_<N>.r<k>``, a later save of the same step: a save never
writes into a folder that exists), committed once its manifest.json exists (docs/checkpoint-format.md,
"On disk"). Of several committed saves of one step the newest is the checkpoint of that step; the older
ones, like BAD and superseded ones, are forensics, kept for people until retention's ``keep_forensic``
drops them. The ``latest`` pointer is informational: the listing is the source of truth.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from checkpoint.durable.manifest import MANIFEST, CheckpointError, CheckpointUnreadable, Manifest, find_manifest
from checkpoint.storage import Loc, location

log = logging.getLogger("trainer")

LATEST = "latest"
BAD_MARKER = "BAD"  # inside a committed checkpoint: recovery found it unusable (text: why)
SUPERSEDED_MARKER = "SUPERSEDED"  # inside a committed checkpoint: of a trajectory a rollback abandoned (why)
_NAME = re.compile(r"^step_(\d{8,})(?:\.r(\d+))?$")


def checkpoint_id(step: int, revision: int = 0) -> str:
    return f"step_{step:08d}" + (f".r{revision}" if revision else "")


def parse(name: str) -> Optional[Tuple[int, int]]:
    """(step, revision) of a checkpoint folder name; None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def step_of(manifest_path: Path) -> int:
    """The step of the checkpoint a manifest belongs to (-1 if its directory is not a step_N)."""
    parsed = parse(Path(str(manifest_path)).parent.name)
    return parsed[0] if parsed else -1


def checkpoint_dir(root, step: int, revision: int = 0) -> Loc:
    return location(root) / checkpoint_id(step, revision)


def fresh_dir(root, step: int) -> Loc:
    """Where a new save of ``step`` goes: step_N, or the next revision when a folder of step N exists
    (committed, damaged or interrupted): what is there is never overwritten."""
    first = checkpoint_dir(root, step)
    if not first.is_dir():
        return first
    taken = [p[1] for e in location(root).entries() if (p := parse(e.name)) is not None and p[0] == step]
    return checkpoint_dir(root, step, max(taken, default=0) + 1)


@dataclass
class CheckpointInfo:
    checkpoint_id: str  # folder name
    path: Loc
    step: int
    committed: bool
    bad: Optional[str]  # why recovery marked it unusable, or None
    manifest: Optional[Manifest]
    superseded: Optional[str] = None  # why it belongs to an abandoned trajectory (a rollback), or None
    unreadable: Optional[str] = None  # committed, but the storage did not deliver its manifest this time
    revision: int = 0  # a later save of the same step
    replaced: bool = False  # committed, but a later save of the same step is committed too


LIST_THREADS = 16  # folders read at once by a listing: on an object store each read is a round trip


def list_checkpoints(root) -> List[CheckpointInfo]:
    """Every checkpoint-like folder (committed or not), newest first. A manifest that does not parse
    makes its folder uncommitted. One the storage failed to deliver (EIO, ESTALE) leaves it committed
    (its manifest is there), with ``manifest`` None and the reason in ``unreadable``: left out, the
    resume would pick an older checkpoint without a word; kept, loading it reads the manifest again
    and skips it for this attempt if it still fails (recovery/resume.py). A listing that fails raises
    its OSError (callers deciding for every rank read again: checkpoint/durable/reads.py).

    One listing of ``root``, then each folder's manifest and markers read straight away (a missing one
    is the answer: no probe before a read), LIST_THREADS folders at a time: on an object store three
    requests a folder, in parallel."""
    root = location(root)
    names = [(e.name, parsed) for e in root.entries() if e.is_dir and (parsed := parse(e.name)) is not None]
    with ThreadPoolExecutor(max(1, min(LIST_THREADS, len(names))), thread_name_prefix="checkpoint-list") as pool:
        out = list(pool.map(lambda item: _folder(root / item[0], *item[1]), names))
    out.sort(key=lambda c: (c.step, c.committed, c.revision), reverse=True)
    newest_of_step = set()
    for c in out:
        if c.committed:
            c.replaced = c.step in newest_of_step
            newest_of_step.add(c.step)
    return out


def _folder(d: Loc, step: int, revision: int) -> CheckpointInfo:
    manifest, unreadable, committed = None, None, True
    try:
        manifest = find_manifest(d)
        committed = manifest is not None
    except CheckpointUnreadable as exc:
        log.warning("%s (listed as committed; loading it reads it again)", exc)
        unreadable = str(exc)
    except CheckpointError as exc:
        log.warning("%s", exc)
        committed = False
    bad, gone = _marker(d / BAD_MARKER, "marked bad"), _marker(d / SUPERSEDED_MARKER, "superseded")
    return CheckpointInfo(d.name, d, step, committed, bad, manifest, gone, unreadable, revision)


def _marker(path: Loc, default: str) -> Optional[str]:
    """A marker's text (``default`` when empty), None when there is none (nor when a folder stands there)."""
    try:
        return path.read_text().strip() or default
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def committed_of(listed: Sequence[CheckpointInfo], include_bad: bool = False,
                 include_superseded: bool = False) -> List[CheckpointInfo]:
    """Of a listing, the committed checkpoints newest first (what resume and recovery choose from):
    without the BAD ones and those of an abandoned trajectory unless asked for."""
    return [c for c in listed if c.committed and not c.replaced and (include_bad or c.bad is None)
            and (include_superseded or c.superseded is None)]


def list_committed(root, include_bad: bool = False, include_superseded: bool = False) -> List[CheckpointInfo]:
    """``committed_of`` a listing of ``root``."""
    return committed_of(list_checkpoints(root), include_bad, include_superseded)


class Listing:
    """One listing of checkpoint.dir, made at its first use and reused by every choice of one decision (a
    resume with its fallbacks and marks, a rollback with its supersede marks, a pre-flight): each choice
    listing again read every manifest again (on an object store, a request per folder and file). Only for
    what nothing else changes meanwhile: this run holds the lease, and a rollback first waits for the save in
    flight and for retention. Made and used on rank 0, inside the decision."""

    def __init__(self, root):
        self.root = location(root)
        self._found: Optional[List[CheckpointInfo]] = None

    def checkpoints(self) -> List[CheckpointInfo]:
        if self._found is None:
            self._found = list_checkpoints(self.root)
        return self._found

    def committed(self, include_bad: bool = False, include_superseded: bool = False) -> List[CheckpointInfo]:
        return committed_of(self.checkpoints(), include_bad, include_superseded)

    def forget(self, ids: Sequence[str]) -> None:
        """Folders removed since the listing (clean_uncommitted's)."""
        gone = set(ids)
        self._found = [c for c in self.checkpoints() if c.checkpoint_id not in gone]


def latest_committed(root, listing: Optional[Listing] = None) -> Optional[CheckpointInfo]:
    found = (listing or Listing(root)).committed()
    return found[0] if found else None


def read_latest_pointer(root) -> Optional[str]:
    p = location(root) / LATEST
    return p.read_text().strip() if p.is_file() else None


def committed_dir(root, step: int, listing: Optional[Listing] = None) -> Loc:
    """The committed checkpoint of ``step`` (its newest save), or step_N's folder when none is committed."""
    found = [c for c in (listing or Listing(root)).checkpoints() if c.step == step and c.committed and not c.replaced]
    return found[0].path if found else checkpoint_dir(root, step)


def resolve_resume(root, spec: str, listing: Optional[Listing] = None) -> Optional[Loc]:
    """The checkpoint to resume from for ``checkpoint.resume=spec``, or None for a fresh start.

    auto: newest committed (None when there is none); never: None; must: newest committed or
    an error; an integer: that step under ``root``; anything else: a checkpoint directory path.
    ``listing``: the decision's (one is made otherwise).
    """
    spec = str(spec).strip()
    if spec == "never":
        return None
    listing = listing or Listing(root)
    if spec in ("auto", "must"):
        newest = latest_committed(root, listing)
        if newest is None and spec == "must":
            others = [c.checkpoint_id + (f" (bad: {c.bad})" if c.bad else "") for c in listing.checkpoints()]
            raise CheckpointError(f"checkpoint.resume=must but {root} holds no usable committed checkpoint"
                                  + (f"; found: {', '.join(others)}" if others else ""))
        return newest.path if newest else None
    if spec.isdigit():
        path = committed_dir(root, int(spec), listing)
        if not (path / MANIFEST).is_file():
            steps = [c.step for c in listing.committed()]
            raise CheckpointError(f"checkpoint.resume={spec}: no committed checkpoint for step {spec} in {root}; "
                                  f"committed steps: {steps or 'none'}")
        return path
    path = location(spec)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint.resume={spec}: not a committed checkpoint directory (no {MANIFEST}); "
                              "use auto, never, must, a step number or a step_N directory")
    return path


# -- marks -------------------------------------------------------------------------------------------
def mark_bad(path, reason: str) -> None:
    """Recovery's verdict: this checkpoint must not be resumed from (it stays on disk for people)."""
    (location(path) / BAD_MARKER).write_text(reason.strip() + "\n")
    log.warning("checkpoint %s marked bad: %s", path, reason)


def mark_superseded(root, after_step: int, reason: str, listing: Optional[Listing] = None) -> List[str]:
    """Lineage: the committed checkpoints newer than ``after_step`` belong to a trajectory that was
    abandoned (a rollback, or an explicit resume to an older step). They stay on disk for people,
    are never chosen by resume=auto and do not count in keep_last; returns their ids. ``listing``: the
    decision's that chose ``after_step``."""
    marked = []
    for c in (listing or Listing(root)).committed(include_bad=True):
        if c.step > after_step:
            (c.path / SUPERSEDED_MARKER).write_text(reason.strip() + "\n")
            marked.append(c.checkpoint_id)
    if marked:
        log.warning("checkpoints %s superseded: %s", ", ".join(marked), reason)
    return marked


# -- retention: which committed checkpoints to keep (docs/checkpoint-format.md, "Retention") ----------------
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
    newest_verified = next((c for c in by_step if c.verified), None)
    if newest_verified is not None and not tiers[newest_verified.step]:
        tiers[newest_verified.step].append("verified")  # what a rollback goes back to
    return tiers


def apply_retention(root, keep_last: int, keep_every: int, keep_best: int, best_metric: str,
                    fault_hook=None, keep_forensic: int = 1) -> List[str]:
    """Delete what the plan drops among the committed, not-bad, not-superseded checkpoints, and the
    forensic folders (BAD, superseded, replaced) but the newest ``keep_forensic``; returns their names."""
    listed = list_checkpoints(root)  # one listing: the plan and the forensic count see the same folders
    committed = [c for c in listed if c.committed and not c.replaced and c.bad is None and c.superseded is None]
    unread = [c.unreadable for c in committed if c.manifest is None]
    if unread:  # its tier and verified flag are unknown: delete nothing on a guess (the next commit retries)
        raise CheckpointUnreadable(f"retention needs every manifest; the storage did not deliver: {'; '.join(unread)}")
    cands = [Candidate(c.step, getattr(c.manifest, best_metric, None), c.manifest.verified) for c in committed]
    plan = retention_plan(cands, keep_last, keep_every, keep_best)
    dropped = [c for c in committed if not plan[c.step]]
    forensic = sorted((c for c in listed if c.committed and (c.bad or c.superseded or c.replaced)),
                      key=lambda c: (c.step, c.revision), reverse=True)  # newest first, a later revision first
    dropped += forensic[max(keep_forensic, 0):]
    for c in dropped:
        remove_checkpoint(c.path, fault_hook)
    if dropped:
        log.info("retention removed %s", ", ".join(c.checkpoint_id for c in dropped))
    return [c.checkpoint_id for c in dropped]


# -- removal ----------------------------------------------------------------------------------------
def remove_checkpoint(path, fault_hook=None) -> None:
    """Delete a checkpoint folder: its manifest first, so a half-deleted one never looks committed."""
    path = location(path)
    (path / MANIFEST).unlink(missing_ok=True)
    if fault_hook is not None:  # recovery's fault injection: a crash mid-deletion
        fault_hook("checkpoint_retention", parse(path.name)[0])
    path.rmtree()


def clean_uncommitted(root, spare_younger_than_s: Optional[float] = None,
                      listing: Optional[Listing] = None) -> List[str]:
    """Remove the folders of interrupted saves and deletions (no manifest), and the uploads a killed writer
    left open. Call only when no save of this process is in flight. With ``spare_younger_than_s`` (a writer
    of an older attempt may still live: checkpoint/durable/lease.py), a leftover written to less than that
    many seconds ago is left for a later start: it may be that writer's save in flight (it stops with
    StaleWriter before committing), and so are open uploads. ``listing``: the decision's, which then forgets
    what was removed."""
    listing = listing or Listing(root)
    removed, spared = [], []
    now = time.time()
    for c in listing.checkpoints():
        if c.committed:
            continue
        if spare_younger_than_s is not None and now - _last_written(c.path) < spare_younger_than_s:
            spared.append(c.checkpoint_id)
            continue
        try:
            remove_checkpoint(c.path)
        except OSError:
            pass  # the next start tries again; discovery never loads it
        removed.append(c.checkpoint_id)
    listing.forget(removed)
    if spared:
        log.warning("left uncommitted %s alone: written to less than %g s ago, while a writer of an older attempt "
                    "may still live (the next start removes them)", ", ".join(sorted(spared)), spare_younger_than_s)
    if spare_younger_than_s is None:
        removed += [f"upload of {key}" for key in location(root).abort_unfinished()]
    if removed:
        log.info("removed uncommitted checkpoint leftovers: %s", ", ".join(sorted(removed)))
    return removed


def _last_written(d: Loc) -> float:
    """The newest modification time of anything in folder ``d`` (now when it cannot be listed: something is
    at work in there)."""
    try:
        return max((e.mtime for e in d.walk()), default=0.0)
    except OSError:
        return time.time()
