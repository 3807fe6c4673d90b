"""Which checkpoint a run resumes from, and what happens when one fails to load or verify.

With ``checkpoint.resume=auto`` the memory tier is tried first (if its newest step is newer than the
newest committed durable checkpoint), then the durable tier; a memory snapshot that fails is forgotten.
A durable checkpoint that fails gets what is proven:
- damage (a checksum wrong on two reads, a wrong size, a file missing on two looks; a post-load
  verification, recovery/verify.py, that fails again on a second load) marks it BAD, and the next
  older one is tried;
- the storage failing (an I/O error, a timeout, bytes that hash right on a second read) is retried
  ``recovery.read_retries`` times with a doubling backoff; then the next older one is tried *for this
  attempt*, with no mark: the next start tries the newest again.
Rank 0 picks each candidate and every rank loads the same one. The guards' rollback
(recovery/guards/rollback.py) uses the same fallback loop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from checkpoint.durable.discovery import (
    Listing,
    clean_uncommitted,
    latest_committed,
    mark_bad,
    mark_superseded,
    parse,
    resolve_resume,
)
from checkpoint.durable.lease import earlier_writers_may_live
from checkpoint.durable.manifest import (
    CheckpointError,
    CheckpointUnreadable,
    ConfigMismatch,
    Manifest,
    VerificationFailed,
)
from checkpoint.durable.reads import read_on_rank0
from checkpoint.manager import CheckpointManager, VerifyHook
from parallel import collectives

log = logging.getLogger("trainer")


def _agreed_path(ckpt: CheckpointManager, decide: Callable[[], Optional[Path]]) -> Optional[Path]:
    """``decide`` on rank 0, read again while the storage fails (recovery.read_retries); every rank
    gets its path (or None, or its CheckpointError: CheckpointUnreadable once the retries are spent)."""
    return read_on_rank0(decide, f"checkpoint.dir={ckpt.root}", *ckpt.retries, errors=(CheckpointError,))


def resume(ckpt: CheckpointManager, verify: Optional[VerifyHook] = None) -> str:
    """Load per checkpoint.resume (and the module docstring's fallback); returns what happened, for the
    banner's 'resume:' field."""
    spec = str(ckpt.cfg.resume)
    listing = Listing(ckpt.root)  # rank 0's, for every choice below (nothing else writes there meanwhile)
    if ckpt.memory is not None and ckpt.memory.enabled and spec == "auto":  # the memory tier first
        newest = _agreed_path(ckpt, lambda: getattr(latest_committed(ckpt.root, listing), "path", None))
        resumed = ckpt.memory.resume(ckpt, verify, newest)
        if resumed is not None:
            return resumed

    def first() -> Optional[Path]:
        # taken over, or another replica group writing: its save in flight is spared
        live = earlier_writers_may_live(ckpt.saver.lease_root, ckpt.saver.attempt)
        clean_uncommitted(ckpt.root, ckpt.cfg.lease_timeout_s if live else None, listing)
        return resolve_resume(ckpt.root, spec, listing)

    def older(failed: Path) -> Optional[Path]:
        found = [c.path for c in listing.committed() if c.step < parse(failed.name)[0]]
        return found[0] if found else None

    t0 = time.perf_counter()
    loaded = load_with_fallback(ckpt, first, older, verify, fallback=spec == "auto")
    if loaded is None:
        return ("fresh start (resume=never)" if spec == "never"
                else f"fresh start (no committed checkpoint in {ckpt.root})")
    manifest, path, skipped = loaded
    if spec not in ("auto", "must"):  # an explicit step or path: newer checkpoints are another trajectory now
        # so the next resume=auto continues from here; marked before anyone trains on (and saves) past it
        supersede(ckpt, manifest.step, f"checkpoint.resume={spec} went back to step {manifest.step}", listing)
        if ckpt.memory is not None:
            ckpt.memory.forget_newer(manifest.step)  # every node its own snapshots
    ckpt.log_event(manifest.step, kind="resume", checkpoint_id=manifest.checkpoint_id, path=str(path),
                   load_s=round(time.perf_counter() - t0, 3), skipped=skipped, source="storage",
                   sources={str(r): "storage" for r in range(ckpt.world_size)},
                   saved_world_size=manifest.world_size, saved_layout=manifest.layout)
    note = f" after skipping {', '.join(skipped)}" if skipped else ""
    return f"from {path} (step {manifest.step}, saved at world {manifest.world_size}){note}"


def load_with_fallback(ckpt: CheckpointManager, first: Callable[[], Optional[Path]],
                       next_after: Callable[[Path], Optional[Path]], verify: Optional[VerifyHook] = None,
                       fallback: bool = True) -> Optional[Tuple[Manifest, Path, List[str]]]:
    """Load the checkpoint ``first()`` picks; while one fails, retry it or mark it bad (the module
    docstring says which), then load ``next_after(failed)`` instead. Rank 0 picks, every rank
    loads the same one, and every rank gets the same error from a load (checkpoint/durable/
    loader.py), so all take the same path. Returns (manifest, path, skipped checkpoint ids), or
    None when ``first()`` picks nothing."""
    path = _agreed_path(ckpt, first)
    if path is None:
        return None
    skipped: List[str] = []
    retries, backoff_s = ckpt.retries
    while True:
        try:
            return _load_trusting_only_proof(ckpt, path, verify, retries, backoff_s), path, skipped
        except ConfigMismatch:
            raise
        except CheckpointUnreadable as exc:
            if not fallback:
                raise
            log.error("%s could not be read after %d retries; skipping it for this attempt (not marked bad): %s",
                      path.name, retries, exc)
            ckpt.log_event(parse(path.name)[0], kind="checkpoint_unreadable", checkpoint_id=path.name,
                           problem=str(exc)[:2000])
            skipped.append(f"{path.name} (unreadable)")
            problem = exc
        except CheckpointError as exc:
            if not fallback:
                raise
            reason = str(exc)
            collectives.decided_on_rank0(lambda: _try_mark_bad(path, reason))  # every rank waits for it
            skipped.append(path.name)
            problem = exc
        failed = path
        path = _agreed_path(ckpt, lambda: next_after(failed))
        if path is None:
            raise CheckpointError(f"no usable checkpoint left in {ckpt.root} after {skipped}: {problem}") from problem
        log.warning("falling back from %s to %s: %s", failed.name, path.name, problem)


def _try_mark_bad(path: Path, reason: str) -> None:
    """Mark a checkpoint whose damage was proven; a mark that cannot be written is a warning: this attempt
    skips the checkpoint all the same, and the next start proves the damage again."""
    try:
        mark_bad(path, reason)
    except OSError as exc:
        log.warning("could not mark %s bad (the next start will check it again): %s", path.name, exc)


def supersede(ckpt: CheckpointManager, step: int, reason: str, listing: Optional[Listing] = None) -> None:
    """Mark the committed checkpoints after ``step`` superseded (rank 0 writes, every rank waits): a mark
    rank 0 cannot write stops every rank alike, since a restart would resume the abandoned trajectory.
    ``listing``: rank 0's, of the decision that chose ``step``."""
    collectives.decided_on_rank0(lambda: mark_superseded(ckpt.root, step, reason, listing), errors=(OSError,))


def _load_trusting_only_proof(ckpt: CheckpointManager, path: Path, verify: Optional[VerifyHook], retries: int,
                              backoff_s: float) -> Manifest:
    """``ckpt.load``, again after an unreadable read (``retries`` times, backoff doubling) and once
    after a failed post-load verification: only a failure that repeats is believed."""
    tries, reverified = 0, False
    while True:
        try:
            return ckpt.load(path, verify)
        except CheckpointUnreadable as exc:
            if tries >= retries:
                raise
            wait = backoff_s * 2 ** tries
            tries += 1
            log.warning("%s: the storage did not deliver (%s); loading it again in %.1f s (retry %d of %d)",
                        path.name, exc, wait, tries, retries)
            time.sleep(wait)
        except VerificationFailed as exc:
            if reverified:
                raise
            reverified = True
            log.warning("%s: %s; loading it again: a mismatch that persists is damage", path.name, exc)
