"""The manifest of a save of step S, durable or memory, and the state metadata that matches it.

It records what post-load verification (recovery/verify.py) compares: the config hash, the world
and layout, the losses, and the probe loss, a forward pass on a fixed batch (recovery/probe.py)
that this builder runs through the callable it is given. It also carries the validation loss of
an evaluation at S (``record_eval``) and the weights' pretrained source (``init_from``). On resume,
``check_resume`` compares a saved manifest's config with this run's.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional, Tuple

from checkpoint.durable.discovery import checkpoint_id
from checkpoint.durable.manifest import ConfigMismatch, Manifest
from checkpoint.state.fingerprint import config_differences, config_hash, hashed_config, schedule_changes
from checkpoint.state.training_state import TrainingState

log = logging.getLogger("trainer")


class ManifestBuilder:
    def __init__(self, config: Dict, global_batch_size: int, state: TrainingState, world_size: int,
                 layout: Dict[str, int], probe: Optional[Callable[[], float]] = None):
        """``config``: the run's resolved config as plain data (recorded whole, hashed in part)."""
        self.global_batch_size, self.state, self.world_size = global_batch_size, state, world_size
        self.layout, self.probe, self.full_config = dict(layout), probe, config
        self.hashed = hashed_config(self.full_config)
        self.config_hash = config_hash(self.hashed)
        self.init_from: Optional[Dict] = None  # {path, kind, hash} (checkpoint/interop/init_from.py)
        self._eval: Optional[Tuple[int, float]] = None  # (step, validation loss) of the latest evaluation

    def check_resume(self, manifest: Manifest, path, allow_config_change: bool) -> None:
        """Log what a resume from ``manifest`` changes in the schedule; raise ConfigMismatch when it was
        saved with another hashed config, unless ``allow_config_change`` (then warn)."""
        changed = schedule_changes(manifest.config, self.full_config)
        if changed:
            log.warning("resume changes the schedule (this run's config applies from step %d on): %s",
                        manifest.step, "; ".join(changed))
        if manifest.config_hash == self.config_hash:
            return
        diffs = config_differences(hashed_config(manifest.config), self.hashed)
        msg = (f"{path} was saved with a different config (hash {manifest.config_hash}, this run "
               f"{self.config_hash}): {'; '.join(diffs) or 'unknown fields'}")
        if not allow_config_change:
            raise ConfigMismatch(msg + ". Resume with the same settings, or set "
                                 "checkpoint.allow_config_change=true to accept the change.")
        log.warning("checkpoint.allow_config_change=true: %s", msg)

    def record_eval(self, step: int, val_loss: float) -> None:
        """The validation loss after ``step``: a save of that step records it in its manifest."""
        self._eval = (step, val_loss)

    def build(self, step: int, loss: Optional[float], probe_method: Optional[str] = None) -> Manifest:
        """The manifest of a save of ``step``; sets the state's metadata to match (before its state
        dict is taken). Runs the probe: post-load verification compares its loss. A caller that proves
        the weights another way names it in ``probe_method`` and runs no probe (the memory tier:
        checkpoint/memory/restore.py)."""
        probe_loss = self.probe() if self.probe is not None and probe_method is None else None
        s, gbs = self.state, self.global_batch_size
        s.meta = {"wall_clock": time.time(), "config_hash": self.config_hash, "world_size": self.world_size,
                  "layout": dict(self.layout), "global_batch_size": gbs, "loss": loss, "probe_loss": probe_loss}
        return Manifest(
            checkpoint_id=checkpoint_id(step), step=step, tokens=s.tokens, samples=s.samples,
            created_at=s.meta["wall_clock"], config_hash=self.config_hash, config=self.full_config,
            world_size=self.world_size, layout=dict(self.layout), init_from=self.init_from,
            global_batch_size=gbs, loss=loss, probe_loss=probe_loss, checksum_algorithm=None,
            probe_method=probe_method or (getattr(self.probe, "method", None) if probe_loss is not None else None),
            probe_kernels=getattr(self.probe, "kernels", None) if probe_loss is not None else None,
            components=s.components(),
            val_loss=self._eval[1] if self._eval is not None and self._eval[0] == step else None)
