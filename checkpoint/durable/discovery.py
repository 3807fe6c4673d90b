"""Finding checkpoints: committed ones newest first, the resume choice, bad marks, leftovers.

Only a directory named ``step_N`` with a manifest counts as committed. The ``latest``
pointer is informational: the scan is the source of truth, so a crash between the commit
rename and the pointer update loses nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from checkpoint.durable.integrity import atomic_write_text, fsync_dir
from checkpoint.durable.layout import (
    BAD_MARKER,
    DELETING,
    LATEST,
    MANIFEST,
    SUPERSEDED_MARKER,
    UNCOMMITTED,
    committed_dir,
    parse,
)
from checkpoint.durable.location import location, on_object_store, remove_tree
from checkpoint.durable.manifest import CheckpointError, CheckpointUnreadable, Manifest, read_manifest

log = logging.getLogger("trainer")


@dataclass
class CheckpointInfo:
    checkpoint_id: str  # directory name
    path: Path
    step: int
    committed: bool
    bad: Optional[str]  # why recovery marked it unusable, or None
    manifest: Optional[Manifest]
    superseded: Optional[str] = None  # why it belongs to an abandoned trajectory (a rollback), or None
    unreadable: Optional[str] = None  # committed, but the storage did not deliver its manifest this time


def list_checkpoints(root: Path) -> List[CheckpointInfo]:
    """Every checkpoint-like directory (committed or not), newest step first. A manifest that does not
    parse makes its directory uncommitted. One the storage failed to deliver (EIO, ESTALE) leaves it
    committed (its manifest is there), with ``manifest`` None and the reason in ``unreadable``: left
    out, the resume would pick an older checkpoint without a word; kept, loading it reads the manifest
    again and skips it for this attempt if it still fails (recovery/resume.py). A listing that fails
    raises its OSError (callers deciding for every rank read again: checkpoint/durable/reads.py)."""
    root = location(root)
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        parsed = parse(d.name)
        if parsed is None or not d.is_dir():
            continue
        step, suffix = parsed
        committed = suffix == "" and (d / MANIFEST).is_file()
        manifest, unreadable = None, None
        if committed:
            try:
                manifest = read_manifest(d)
            except CheckpointUnreadable as exc:
                log.warning("%s (listed as committed; loading it reads it again)", exc)
                unreadable = str(exc)
            except CheckpointError as exc:
                log.warning("%s", exc)
                committed = False
        bad = (d / BAD_MARKER).read_text().strip() or "marked bad" if (d / BAD_MARKER).exists() else None
        gone = (d / SUPERSEDED_MARKER).read_text().strip() or "superseded" if (d / SUPERSEDED_MARKER).exists() \
            else None
        out.append(CheckpointInfo(d.name, d, step, committed, bad, manifest, gone, unreadable))
    return sorted(out, key=lambda c: (c.step, c.committed), reverse=True)


def list_committed(root: Path, include_bad: bool = False, include_superseded: bool = False) -> List[CheckpointInfo]:
    """Committed checkpoints newest first (what resume and recovery choose from): without the BAD
    ones and those of an abandoned trajectory unless asked for."""
    return [c for c in list_checkpoints(root) if c.committed and (include_bad or c.bad is None)
            and (include_superseded or c.superseded is None)]


def latest_committed(root: Path) -> Optional[CheckpointInfo]:
    found = list_committed(root)
    return found[0] if found else None


def read_latest_pointer(root: Path) -> Optional[str]:
    p = location(root) / LATEST
    return p.read_text().strip() if p.is_file() else None


def mark_bad(path: Path, reason: str) -> None:
    """Recovery's verdict: this checkpoint must not be resumed from (it stays on disk for people)."""
    atomic_write_text(location(path) / BAD_MARKER, reason.strip() + "\n")
    log.warning("checkpoint %s marked bad: %s", path, reason)


def mark_superseded(root: Path, after_step: int, reason: str) -> List[str]:
    """Lineage: the committed checkpoints newer than ``after_step`` belong to a trajectory that was
    abandoned (a rollback, or an explicit resume to an older step). They stay on disk for people,
    are never chosen by resume=auto and do not count in keep_last; returns their ids."""
    marked = []
    for c in list_committed(root, include_bad=True):
        if c.step > after_step:
            atomic_write_text(c.path / SUPERSEDED_MARKER, reason.strip() + "\n")
            marked.append(c.checkpoint_id)
    if marked:
        log.warning("checkpoints %s superseded: %s", ", ".join(marked), reason)
    return marked


def clean_uncommitted(root: Path, spare_younger_than_s: Optional[float] = None) -> List[str]:
    """Remove leftovers of interrupted saves and deletions. Call only when no save of this process is in flight.
    With ``spare_younger_than_s`` (a writer of an older attempt may still live: checkpoint/durable/lease.py),
    a leftover written to less than that many seconds ago is left for a later start: it may be that writer's
    save in flight (it stops with StaleWriter before committing)."""
    removed, spared = [], []
    root = location(root)
    if not root.is_dir():
        return removed
    remote = on_object_store(root)
    now = time.time()
    for d in root.iterdir():
        parsed = parse(d.name)
        if not parsed or not d.is_dir():
            continue
        interrupted = parsed[1] == UNCOMMITTED or parsed[1].endswith(DELETING)
        if remote:  # there, an interrupted save is a step_N/ without a manifest
            interrupted = parsed[1] == "" and not (d / MANIFEST).is_file()
        if interrupted and spare_younger_than_s is not None and now - _last_written(d) < spare_younger_than_s:
            spared.append(d.name)
        elif interrupted:
            try:
                remove_tree(d)
            except OSError:
                pass  # the next start tries again; discovery never loads it
            removed.append(d.name)
    if spared:
        log.warning("left uncommitted %s alone: written to less than %g s ago, while a writer of an older attempt "
                    "may still live (the next start removes them)", ", ".join(sorted(spared)), spare_younger_than_s)
    if remote and spare_younger_than_s is None:  # parts of uploads a killed writer left open (kept until aborted)
        removed += [f"upload of {key}" for key in root.abort_uploads()]
    elif remote:  # an older writer may still be uploading (a store's upload start times are not trusted here)
        log.warning("left open multipart uploads alone while a writer of an older attempt may still live "
                    "(the next start aborts them)")
    if removed:
        fsync_dir(root)
        log.info("removed uncommitted checkpoint leftovers: %s", ", ".join(sorted(removed)))
    return removed


def _last_written(d: Path) -> float:
    """The newest modification time of directory ``d`` and everything in it (0 when it vanished meanwhile)."""
    newest = 0.0
    try:
        inside = list(d.rglob("*"))
    except OSError:  # a subfolder removed while it was listed: something is at work in there now
        return time.time()
    for p in [d, *inside]:
        try:
            newest = max(newest, p.stat().st_mtime)
        except OSError:  # removed meanwhile (a writer's temporary file)
            pass
    return newest


def resolve_resume(root: Path, spec: str) -> Optional[Path]:
    """The checkpoint to resume from for ``checkpoint.resume=spec``, or None for a fresh start.

    auto: newest committed (None when there is none); never: None; must: newest committed or
    an error; an integer: that step under ``root``; anything else: a checkpoint directory path.
    """
    spec = str(spec).strip()
    if spec == "never":
        return None
    if spec in ("auto", "must"):
        newest = latest_committed(root)
        if newest is None and spec == "must":
            others = [c.checkpoint_id + (f" (bad: {c.bad})" if c.bad else "") for c in list_checkpoints(root)]
            raise CheckpointError(f"checkpoint.resume=must but {root} holds no usable committed checkpoint"
                                  + (f"; found: {', '.join(others)}" if others else ""))
        return newest.path if newest else None
    if spec.isdigit():
        path = committed_dir(root, int(spec))
        if not (path / MANIFEST).is_file():
            steps = [c.step for c in list_committed(root)]
            raise CheckpointError(f"checkpoint.resume={spec}: no committed checkpoint for step {spec} in {root}; "
                                  f"committed steps: {steps or 'none'}")
        return path
    path = location(spec)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint.resume={spec}: not a committed checkpoint directory (no {MANIFEST}); "
                              "use auto, never, must, a step number or a step_N directory")
    return path
