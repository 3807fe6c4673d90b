"""What train.py calls: preflight, resume, save when due, log timings, close.

Ties the modules together: TrainingState (what), CheckpointSaver (how, sync or async, with
the commit protocol), loader (resume, resharding), discovery and retention (which).
"""

from __future__ import annotations

import datetime
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from checkpoint.discovery import clean_uncommitted, list_committed, mark_bad, resolve_resume
from checkpoint.fingerprint import config_differences, config_hash, hashed_config
from checkpoint.integrity import default_algorithm
from checkpoint.layout import checkpoint_id, parse
from checkpoint.loader import any_rank, load_checkpoint
from checkpoint.manifest import CheckpointError, Manifest
from checkpoint.preflight import expected_checkpoint_bytes, preflight_checkpoint_dir
from checkpoint.retention import apply_retention
from checkpoint.saver import CheckpointSaver, FaultHook, SaveRecord
from checkpoint.state import TrainingState

log = logging.getLogger("trainer")

AUTO_MEASURE_STEPS = 5  # checkpoint.interval=auto: the first save, which measures the cost

# A post-load check (recovery): returns None when the loaded state is good, else the reason.
VerifyHook = Callable[[Manifest, Path], Optional[str]]


class CheckpointManager:
    def __init__(self, cfg, state: TrainingState, *, rank: int, world_size: int, dims,
                 device: torch.device, metrics=None, probe: Optional[Callable[[], float]] = None,
                 fault_hook: Optional[FaultHook] = None):
        c = cfg.checkpoint
        self.cfg, self.ckpt_cfg, self.state = cfg, c, state
        self.rank, self.world_size, self.device = rank, world_size, device
        self.layout = {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "tp")}
        self.root = Path(c.dir)
        # "auto": recovery/runtime.py measures a first save, then sets the Young/Daly interval here
        self.interval = AUTO_MEASURE_STEPS if str(c.interval).strip() == "auto" else int(c.interval)
        self.metrics, self.probe = metrics, probe
        self.hashed = hashed_config(cfg)
        self.config_hash = config_hash(self.hashed)
        self._housekeeping = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-retention")
        group = None
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            # Own gloo group: DCP's collectives (from a background thread in async mode) must not
            # interleave with training collectives on the default group.
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=c.commit_timeout_s))
        self.saver = CheckpointSaver(
            self.root, c.async_mode, rank, world_size, process_group=group,
            checksum_algorithm=default_algorithm() if c.checksum else None,
            commit_timeout_s=c.commit_timeout_s, pin_memory=device.type == "cuda",
            after_commit=self._after_commit, fault_hook=fault_hook)
        self.last_saved_step: Optional[int] = None
        # Set by the guards (recovery/guards): why the next save must not be marked verified.
        self.unverified_reason: Callable[[], Optional[str]] = lambda: None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    # -- before step 1 -------------------------------------------------------------------
    def preflight(self) -> None:
        if self.enabled:
            preflight_checkpoint_dir(self.root, expected_checkpoint_bytes(self.state.model, ema=self.state.ema is not None),
                                     self.ckpt_cfg.keep_last, self.rank)

    def resume(self, verify: Optional[VerifyHook] = None) -> str:
        """Load per checkpoint.resume; returns what happened, for the banner's 'resume:' field.

        With resume=auto a checkpoint that fails verification (checksums, or ``verify``) is
        marked bad and the next older committed one is tried.
        """
        spec = str(self.ckpt_cfg.resume)
        choice = [None, None]
        if self.rank == 0:
            try:
                clean_uncommitted(self.root)
                path = resolve_resume(self.root, spec)
                choice = [str(path) if path else None, None]
            except CheckpointError as exc:
                choice = [None, str(exc)]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[1]:
            raise CheckpointError(choice[1])
        if choice[0] is None:
            return "fresh start (resume=never)" if spec == "never" else f"fresh start (no committed checkpoint in {self.root})"
        path = Path(choice[0])
        skipped: List[str] = []
        t0 = time.perf_counter()
        while True:
            try:
                manifest = self._load(path, verify)
                break
            except ConfigMismatch:
                raise
            except CheckpointError as exc:
                if spec != "auto":
                    raise
                if self.rank == 0:
                    mark_bad(path, str(exc))
                    skipped.append(path.name)
                older = [c.path for c in list_committed(self.root) if c.step < parse(path.name)[0]]
                nxt = [str(older[0]) if older else None]
                if dist.is_available() and dist.is_initialized():
                    dist.broadcast_object_list(nxt, src=0)
                if nxt[0] is None:
                    raise CheckpointError(f"no usable checkpoint left in {self.root} after {skipped}: {exc}") from exc
                log.warning("falling back from %s to %s: %s", path.name, Path(nxt[0]).name, exc)
                path = Path(nxt[0])
        self._log_event(manifest.step, kind="resume", checkpoint_id=manifest.checkpoint_id, path=str(path),
                        load_s=round(time.perf_counter() - t0, 3), skipped=skipped,
                        saved_world_size=manifest.world_size, saved_layout=manifest.layout)
        note = f" after skipping {', '.join(skipped)}" if skipped else ""
        return f"from {path} (step {manifest.step}, saved at world {manifest.world_size}){note}"

    def load(self, path: Path) -> Manifest:
        """Load one committed checkpoint into the live state (the guards' rollback); checks files."""
        return self._load(Path(path), None)

    def _load(self, path: Path, verify: Optional[VerifyHook]) -> Manifest:
        from checkpoint.manifest import read_manifest

        manifest = read_manifest(path)
        if manifest.config_hash != self.config_hash:
            diffs = config_differences(manifest.config, self.hashed)
            msg = (f"{path} was saved with a different config (hash {manifest.config_hash}, this run "
                   f"{self.config_hash}): {'; '.join(diffs) or 'unknown fields'}")
            if not self.ckpt_cfg.allow_config_change:
                raise ConfigMismatch(msg + ". Resume with the same settings, or set "
                                     "checkpoint.allow_config_change=true to accept the change.")
            log.warning("checkpoint.allow_config_change=true: %s", msg)
        t0 = time.perf_counter()
        manifest = load_checkpoint(self.state, path, seed=self.cfg.seed, verify=self.ckpt_cfg.verify_on_load,
                                   threads=self.ckpt_cfg.load_threads, device=self.device)
        log.info("loaded %s in %.2f s", path, time.perf_counter() - t0)
        problem = verify(manifest, path) if verify is not None else None
        if any_rank(problem is not None, self.device):
            raise CheckpointError(f"{path} failed post-load verification: {problem or 'on another rank'}")
        return manifest

    # -- the loop ----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        return step % self.interval == 0 or (self.ckpt_cfg.save_final and step == self.cfg.training.steps)

    def after_step(self, step: int, loss: float) -> None:
        """Call after every optimizer step (1-based ``step``): saves when due, reports finished saves."""
        if self.due(step):
            self.save(step, loss)
        else:
            self.saver.poll()
        self._report()

    def save(self, step: int, loss: Optional[float]) -> None:
        probe_loss = self.probe() if self.probe is not None else None
        s = self.state
        s.meta = {"wall_clock": time.time(), "config_hash": self.config_hash, "world_size": self.world_size,
                  "layout": dict(self.layout), "global_batch_size": self.cfg.training.global_batch_size,
                  "loss": loss, "probe_loss": probe_loss}
        manifest = Manifest(
            checkpoint_id=checkpoint_id(step), step=step, tokens=s.tokens, samples=s.samples,
            created_at=s.meta["wall_clock"], config_hash=self.config_hash, config=self.hashed,
            world_size=self.world_size, layout=dict(self.layout),
            global_batch_size=self.cfg.training.global_batch_size, loss=loss, probe_loss=probe_loss,
            checksum_algorithm=None, components=s.components())
        reason = self.unverified_reason()
        if reason is not None:
            manifest.verified, manifest.unverified_reason = False, reason
            log.warning("checkpoint %s will not be marked verified: %s", manifest.checkpoint_id, reason)
        self.saver.save(s.state_dict(), manifest)
        self.last_saved_step = step

    def close(self) -> None:
        """Wait for the in-flight save and for retention; report."""
        self.saver.close()
        self._report()
        self._housekeeping.shutdown(wait=True)

    # -- helpers ---------------------------------------------------------------------------
    def _after_commit(self, manifest: Manifest) -> None:
        self._housekeeping.submit(self._retention, manifest.step)

    def _retention(self, step: int) -> None:
        c = self.ckpt_cfg
        try:
            apply_retention(self.root, c.keep_last, c.keep_every, c.keep_best, c.best_metric,
                            fault_hook=self.saver.fault_hook)
        except Exception:  # retention must never stop training; the next commit retries
            log.exception("retention after step %d failed", step)

    def _report(self) -> None:
        for r in self.saver.finished():
            self._record(r)

    def _record(self, r: SaveRecord) -> None:
        log.info("checkpoint %s (%s): blocked training %.3f s (%.3f s waiting for the previous save), "
                 "background %.3f s, %.1f MiB%s", r.checkpoint_id, r.mode, r.blocking_s, r.waited_s,
                 r.background_s, r.bytes / 2**20, ", committed" if r.committed else "")
        self._log_event(r.step, kind="checkpoint", checkpoint_id=r.checkpoint_id, mode=r.mode,
                        blocking_s=r.blocking_s, waited_s=r.waited_s, background_s=r.background_s,
                        bytes=r.bytes, committed=r.committed)

    def _log_event(self, step: int, **fields) -> None:
        if self.metrics is not None:
            self.metrics.log_event(step, **fields)


class ConfigMismatch(CheckpointError):
    """The checkpoint was written with settings a resume must not change."""
