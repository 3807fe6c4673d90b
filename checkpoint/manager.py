"""What the training run calls: preflight, resume, save when due, log timings, close.

Ties the modules together: TrainingState (what), CheckpointSaver (how, sync or async, with
the commit protocol), loader (resume, resharding), discovery and retention (which). Recovery
(recovery/runtime.py) drives it through the public methods below; nothing else reaches in.
"""

from __future__ import annotations

import datetime
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from checkpoint.discovery import clean_uncommitted, list_committed, mark_bad, resolve_resume
from checkpoint.fingerprint import config_differences, config_hash, full_config, hashed_config, schedule_changes
from checkpoint.integrity import default_algorithm
from checkpoint.layout import checkpoint_id, parse
from checkpoint.loader import any_rank, from_rank0, load_checkpoint
from checkpoint.manifest import CheckpointError, ConfigMismatch, Manifest, read_manifest
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
        # "auto": recovery/runtime.py measures a first save, then calls set_interval (Young/Daly)
        self.interval = AUTO_MEASURE_STEPS if str(c.interval).strip() == "auto" else int(c.interval)
        self.metrics, self.probe = metrics, probe
        self.full_config = full_config(cfg)
        self.hashed = hashed_config(self.full_config)
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
        self._eval: Optional[Tuple[int, float]] = None  # (step, validation loss) of the latest evaluation

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def set_interval(self, steps: int) -> None:
        """Save every ``steps`` steps from now on (checkpoint.interval=auto decides it at run time)."""
        if steps < 1:
            raise ValueError(f"checkpoint interval {steps} must be >= 1")
        self.interval = int(steps)

    # -- before step 1 -------------------------------------------------------------------
    def preflight(self) -> None:
        if self.enabled:
            expected = expected_checkpoint_bytes(self.state.model, ema=self.state.ema is not None)
            preflight_checkpoint_dir(self.root, expected, self.ckpt_cfg.keep_last, self.rank)

    def resume(self, verify: Optional[VerifyHook] = None) -> str:
        """Load per checkpoint.resume; returns what happened, for the banner's 'resume:' field.

        With resume=auto a checkpoint that fails verification (checksums, or ``verify``) is
        marked bad and the next older committed one is tried.
        """
        spec = str(self.ckpt_cfg.resume)

        def first() -> Optional[Path]:
            clean_uncommitted(self.root)
            return resolve_resume(self.root, spec)

        def older(failed: Path) -> Optional[Path]:
            found = [c.path for c in list_committed(self.root) if c.step < parse(failed.name)[0]]
            return found[0] if found else None

        t0 = time.perf_counter()
        loaded = self.load_with_fallback(first, older, verify, fallback=spec == "auto")
        if loaded is None:
            return ("fresh start (resume=never)" if spec == "never"
                    else f"fresh start (no committed checkpoint in {self.root})")
        manifest, path, skipped = loaded
        self.log_event(manifest.step, kind="resume", checkpoint_id=manifest.checkpoint_id, path=str(path),
                       load_s=round(time.perf_counter() - t0, 3), skipped=skipped,
                       saved_world_size=manifest.world_size, saved_layout=manifest.layout)
        note = f" after skipping {', '.join(skipped)}" if skipped else ""
        return f"from {path} (step {manifest.step}, saved at world {manifest.world_size}){note}"

    def load_with_fallback(self, first: Callable[[], Optional[Path]], next_after: Callable[[Path], Optional[Path]],
                           verify: Optional[VerifyHook] = None,
                           fallback: bool = True) -> Optional[Tuple[Manifest, Path, List[str]]]:
        """Load the checkpoint ``first()`` picks; while one fails (checksums, ``verify``), mark it
        bad and load ``next_after(failed)`` instead. Rank 0 picks, every rank loads the same one.
        Returns (manifest, path, skipped checkpoint ids), or None when ``first()`` picks nothing."""
        path = from_rank0(first)
        if path is None:
            return None
        skipped: List[str] = []
        while True:
            try:
                return self._load(path, verify), path, skipped
            except ConfigMismatch:
                raise
            except CheckpointError as exc:
                if not fallback:
                    raise
                if self.rank == 0:
                    mark_bad(path, str(exc))
                skipped.append(path.name)
                failed = path
                path = from_rank0(lambda: next_after(failed))
                if path is None:
                    raise CheckpointError(f"no usable checkpoint left in {self.root} after {skipped}: {exc}") from exc
                log.warning("falling back from %s to %s: %s", failed.name, path.name, exc)

    def wait(self) -> None:
        """Block until the save in flight (if any) is done on this rank, and report it."""
        self.saver.wait()
        self._report()

    @property
    def writing(self) -> Optional[Tuple[int, Callable[[], bool]]]:
        """(step, is_done) of the background write in flight, or None. ``is_done`` is thread-safe."""
        return self.saver.in_flight

    def _load(self, path: Path, verify: Optional[VerifyHook]) -> Manifest:
        manifest = read_manifest(path)
        changed = schedule_changes(manifest.config, self.full_config)
        if changed:
            log.warning("resume changes the schedule (this run's config applies from step %d on): %s",
                        manifest.step, "; ".join(changed))
        if manifest.config_hash != self.config_hash:
            diffs = config_differences(hashed_config(manifest.config), self.hashed)
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

    def after_step(self, step: int, loss: float,
                   verified_gate: Optional[Callable[[], Optional[str]]] = None) -> List[SaveRecord]:
        """Call after every optimizer step (1-based ``step``): saves when due; returns the records
        of the saves that finished since the last call. ``verified_gate()``, asked only when a
        save happens, gives the reason this save must not be marked verified (or None)."""
        if self.due(step):
            self.save(step, loss, verified_gate() if verified_gate is not None else None)
        else:
            self.saver.poll()
        return self._report()

    def record_eval(self, step: int, val_loss: float) -> None:
        """The validation loss after ``step``: a save of that step records it in its manifest."""
        self._eval = (step, val_loss)

    def save(self, step: int, loss: Optional[float], unverified_reason: Optional[str] = None) -> None:
        """Save now (preemption, the loop's due saves); ``unverified_reason``: not marked verified."""
        probe_loss = self.probe() if self.probe is not None else None
        s = self.state
        s.meta = {"wall_clock": time.time(), "config_hash": self.config_hash, "world_size": self.world_size,
                  "layout": dict(self.layout), "global_batch_size": self.cfg.training.global_batch_size,
                  "loss": loss, "probe_loss": probe_loss}
        manifest = Manifest(
            checkpoint_id=checkpoint_id(step), step=step, tokens=s.tokens, samples=s.samples,
            created_at=s.meta["wall_clock"], config_hash=self.config_hash, config=self.full_config,
            world_size=self.world_size, layout=dict(self.layout),
            global_batch_size=self.cfg.training.global_batch_size, loss=loss, probe_loss=probe_loss,
            checksum_algorithm=None, components=s.components(),
            val_loss=self._eval[1] if self._eval is not None and self._eval[0] == step else None)
        if unverified_reason is not None:
            manifest.verified, manifest.unverified_reason = False, unverified_reason
            log.warning("checkpoint %s will not be marked verified: %s", manifest.checkpoint_id, unverified_reason)
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

    def _report(self) -> List[SaveRecord]:
        records = self.saver.finished()
        for r in records:
            self._record(r)
        return records

    def _record(self, r: SaveRecord) -> None:
        log.info("checkpoint %s (%s): blocked training %.3f s (%.3f s waiting for the previous save), "
                 "background %.3f s, %.1f MiB%s", r.checkpoint_id, r.mode, r.blocking_s, r.waited_s,
                 r.background_s, r.bytes / 2**20, ", committed" if r.committed else "")
        self.log_event(r.step, kind="checkpoint", checkpoint_id=r.checkpoint_id, mode=r.mode,
                        blocking_s=r.blocking_s, waited_s=r.waited_s, background_s=r.background_s,
                        bytes=r.bytes, committed=r.committed)

    def log_event(self, step: int, **fields) -> None:
        """A record in metrics.jsonl (rank 0), e.g. a resume or a rollback."""
        if self.metrics is not None:
            self.metrics.log_event(step, **fields)
