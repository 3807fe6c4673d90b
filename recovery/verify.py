"""A resumed run proves itself (contract 7) before it trains another step.

Checksums (checkpoint/durable/loader.py) prove the files are the ones written, not that what was
written is what training had, nor that it was restored into the right places. After the load:

  step   the restored step counter equals the manifest's;
  LR     the optimizer's LR equals this run's schedule at that step;
  probe  the stored probe loss is reproduced, on the batch its ``probe_method`` names (recovery/probe.py):
         bitwise at the same layout on the same device and kernels (the manifest's ``probe_kernels``),
         else within ``probe_rtol_reshard`` (another reduction order changes the last bits). A memory
         snapshot has none: its restore compared every applied tensor with the snapshot's bytes
         (checkpoint/memory/snapshot.py).

Only a failure that means the bytes are wrong (the step, the probe on unchanged weights) is returned:
the manager marks the checkpoint BAD and falls back to the previous one. A config change never condemns
a checkpoint: the LR is rebuilt from this run's config (training/schedule.py), so a mismatch is a bug and
stops the run (RecoveryError) marking nothing; after an allowed change of a hashed setting the probe is
only logged. The fallback is bounded (``max_fallbacks``), and a directory whose committed checkpoints are
all BAD refuses to start from scratch (a silent fresh start would throw the run away and loop).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable, Optional

from checkpoint.durable.discovery import list_committed, parse
from checkpoint.durable.manifest import APPLIED_BYTES, ConfigMismatch, Manifest
from checkpoint.durable.reads import read_on_rank0
from checkpoint.storage import location
from training.schedule import schedule_lr

log = logging.getLogger("trainer")


class RecoveryError(RuntimeError):
    """Recovery cannot continue safely; the message says what was tried and what to do."""


def probe_matches(saved: float, now: float, same_layout: bool, rtol: float) -> bool:
    if not (math.isfinite(saved) and math.isfinite(now)):
        return False
    return now == saved if same_layout else abs(now - saved) <= rtol * abs(saved)


def refuse_all_bad(root: Path) -> None:
    """With resume=auto, a directory holding committed checkpoints that are all bad is an error."""
    good = list_committed(root)
    every = list_committed(root, include_bad=True)
    if every and not good:
        reasons = "; ".join(f"{c.checkpoint_id}: {c.bad}" for c in every)
        raise RecoveryError(
            f"every committed checkpoint in {root} is marked bad ({reasons}). Refusing to start from scratch "
            "over them: inspect them (scripts/inspect_checkpoints.py), delete a BAD marker to retry one, or "
            "set checkpoint.resume=never to start a new run deliberately.")


class ResumeVerifier:
    """The ``verify`` hook for ``CheckpointManager.resume``: called on every rank after a load."""

    def __init__(self, rc, optim, steps: int, ckpt, state, probe: Optional[Callable[[], float]], layout: dict,
                 world_size: int, inject: Optional[Callable[..., None]] = None):
        """``rc``: the recovery section; ``optim`` and ``steps``: the schedule the LR must follow; ``ckpt``: the
        CheckpointManager (its directory, read retries, this run's config hash and global batch)."""
        self.cfg, self.optim, self.steps, self.state, self.probe = rc, optim, steps, state, probe
        self.inject = inject or (lambda phase, step: None)  # the run's fault injector (recovery/faults.py)
        self.layout, self.world_size = dict(layout), world_size
        self.root, self.retries = ckpt.root, ckpt.retries
        self.config_hash, self.global_batch_size = ckpt.config_hash, ckpt.global_batch_size
        self.report: dict = {}

    def __call__(self, manifest: Manifest, path: Path) -> Optional[str]:
        self.inject("checkpoint_load", manifest.step)
        self._check_global_batch(manifest)
        self._check_depth(path)
        problems = []
        if self.state.step != manifest.step:
            problems.append(f"restored step {self.state.step} != manifest step {manifest.step}")
        lr_now = self.state.optimizer.param_groups[0]["lr"]
        lr_expected = schedule_lr(self.optim, self.steps, manifest.step)
        if not problems and lr_now != lr_expected:  # the config's LR was applied at load: a bug, not bad bytes
            raise RecoveryError(
                f"after loading {path}: optimizer LR {lr_now!r} != this run's schedule {lr_expected!r} at step "
                f"{manifest.step}. The LR is rebuilt from the config at load (training/schedule.py:apply_config); "
                "a mismatch means that did not happen. The checkpoint is not marked bad.")
        same_layout = manifest.world_size == self.world_size and dict(manifest.layout) == self.layout
        # bitwise only for a probe computed the same way, on the same kind of device with the same kernels
        # (recovery/probe.py kernel_identity); otherwise within probe_rtol_reshard, as across layouts
        same_kernels = manifest.probe_kernels is not None and manifest.probe_kernels == getattr(
            self.probe, "kernels", None)
        same_probe = same_layout and same_kernels and manifest.probe_method in getattr(self.probe, "methods", ())
        config_changed = manifest.config_hash != self.config_hash
        probe_now, probe_s = None, None
        bytes_checked = manifest.probe_method == APPLIED_BYTES  # a memory snapshot (checkpoint/memory/snapshot.py)
        if manifest.probe_loss is not None and self.probe is not None:
            probe_now = self.probe.value_for(manifest.probe_method, manifest.probe_samples)
            probe_s = getattr(self.probe, "last_seconds", None)
            matches = probe_matches(manifest.probe_loss, probe_now, same_probe, self.cfg.probe_rtol_reshard)
            if not matches and config_changed:
                log.warning("probe loss %r != stored %r after an allowed config change: the weights' checksums "
                            "passed; the probe cannot be compared across the change", probe_now, manifest.probe_loss)
            elif not matches:
                rule = "bitwise (same layout)" if same_probe else f"rtol {self.cfg.probe_rtol_reshard}"
                problems.append(f"probe loss {probe_now!r} != stored {manifest.probe_loss!r} ({rule})")
        elif self.cfg.verify and not bytes_checked:
            problems.append("the manifest has no probe loss to verify the weights with")
        self.report = {"checkpoint": str(path), "step": manifest.step, "lr": lr_now, "probe_loss": probe_now,
                       "stored_probe_loss": manifest.probe_loss, "same_layout": same_layout, "problems": problems,
                       "probe_s": probe_s}
        if problems:
            log.error("post-load verification of %s failed: %s", path, "; ".join(problems))
            return "; ".join(problems)
        if bytes_checked:
            log.info("post-load verification of %s passed: step %d, LR %.6e = schedule; weights: every tensor "
                     "equal to the snapshot's bytes (no probe)", path.name, manifest.step, lr_now)
            return None
        log.info("post-load verification of %s passed: step %d, LR %.6e = schedule, probe loss %r %s stored "
                 "(probe %.2f s)", path.name, manifest.step, lr_now, probe_now,
                 "(not compared: config changed)" if config_changed else "== (bitwise)" if same_probe
                 else "~= (resharded)" if not same_layout else "~= (other device or kernels)" if not same_kernels
                 else "~= (stored by an earlier probe method)", probe_s or 0.0)
        return None

    def _check_global_batch(self, manifest: Manifest) -> None:
        saved, now = manifest.global_batch_size, self.global_batch_size
        if saved == now:
            return
        msg = (f"{manifest.checkpoint_id} was trained with global_batch_size={saved}, this run has {now}: "
               "the trajectory would change")
        if not self.cfg.allow_global_batch_change:
            raise ConfigMismatch(msg + ". Resume with training.global_batch_size=" + str(saved) +
                                 ", or set recovery.allow_global_batch_change=true (and "
                                 "checkpoint.allow_config_change=true) to accept it.")
        log.warning("recovery.allow_global_batch_change=true: %s", msg)

    def _check_depth(self, path: Path) -> None:
        """Stop after ``max_fallbacks`` fallbacks: count the committed checkpoints newer than ``path``."""
        try:
            step = parse(location(path).name)[0]
        except (TypeError, IndexError):
            return
        newer = read_on_rank0(  # one listing, the same count on every rank
            lambda: [f"{c.checkpoint_id} ({c.bad or 'failed'})" for c in list_committed(self.root, include_bad=True)
                     if c.step > step], f"checkpoint.dir={self.root}", *self.retries)
        limit = self.cfg.max_fallbacks
        if len(newer) > limit:
            tried = ", ".join(newer)
            raise RecoveryError(
                f"verified resume gave up: {len(newer)} newer checkpoints failed ({tried}), more than "
                f"recovery.max_fallbacks={limit}. Something is systematically wrong (storage, code or config); "
                "inspect the checkpoints before restarting, or raise recovery.max_fallbacks.")
