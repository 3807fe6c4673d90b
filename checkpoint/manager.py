"""What the training run calls: preflight, resume, save when due, log timings, close.

Ties the modules together: TrainingState (what), CheckpointSaver (how, sync or async, with
the commit protocol), loader (resume, resharding), discovery and retention (which). Recovery
(recovery/runtime.py) drives it through the public methods below; nothing else reaches in.

A save the storage refused (CheckpointSaveError: disk full, read-only, over quota) is an
alarm in metrics.jsonl either way; ``checkpoint.on_save_error=continue`` trains on (the next
interval tries again), ``stop`` keeps it in ``save_failure`` until recovery/runtime.py has
agreed with the other ranks on the step to stop at, then ``raise_save_failure`` raises it.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from checkpoint.durable.discovery import clean_uncommitted, latest_committed, list_committed, mark_bad, resolve_resume
from checkpoint.durable.integrity import default_algorithm
from checkpoint.durable.layout import checkpoint_id, parse
from checkpoint.durable.lease import check_lease, take_lease
from checkpoint.durable.loader import any_rank, from_rank0, load_checkpoint
from checkpoint.durable.manifest import CheckpointError, ConfigMismatch, Manifest, read_manifest
from checkpoint.durable.preflight import PreflightError, expected_checkpoint_bytes, preflight_checkpoint_dir
from checkpoint.durable.retention import apply_retention
from checkpoint.durable.save_errors import CheckpointSaveError
from checkpoint.durable.saver import CheckpointSaver, FaultHook, SaveRecord
from checkpoint.memory.tier import STEP_DIR, MemoryTier, Restored, SnapshotRecord
from checkpoint.state.fingerprint import config_differences, config_hash, full_config, hashed_config, schedule_changes
from checkpoint.state.training_state import TrainingState

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
        self.interval = AUTO_MEASURE_STEPS if str(c.interval).strip().lower() == "auto" else int(c.interval)
        self.metrics, self.probe = metrics, probe
        self.init_from: Optional[Dict] = None  # the weights' pretrained source, for the manifests (init_from.py)
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
            after_commit=self._after_commit, fault_hook=fault_hook, storage_format=c.format)
        self.memory: Optional[MemoryTier] = None  # checkpoint.memory (checkpoint/memory/tier.py)
        m = c.memory
        if str(m.interval).strip().lower() == "auto" or int(m.interval) > 0:
            self.memory = MemoryTier(m, run_name=cfg.run_name, rank=rank, world_size=world_size,
                                     local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                                     layout=self.layout, config_hash=self.config_hash,
                                     algorithm=default_algorithm(), pin_memory=device.type == "cuda",
                                     timeout_s=c.commit_timeout_s)
            if str(m.interval).strip().lower() == "auto":  # recovery/runtime.py measures, then sets it
                self.memory.set_interval(AUTO_MEASURE_STEPS)
        self.last_saved_step: Optional[int] = None
        self.save_failure: Optional[CheckpointSaveError] = None  # on_save_error=stop: raised once agreed
        self._eval: Optional[Tuple[int, float]] = None  # (step, validation loss) of the latest evaluation
        self._memory_records: List[SnapshotRecord] = []

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
        """Before resume: take this attempt's lease on checkpoint.dir (checkpoint/durable/lease.py), so an
        older attempt's writers can no longer commit there; then check the directory has room
        for the saves to come (checkpoint/durable/preflight.py)."""
        lease = [None, None]  # (attempt, why it could not be taken)
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                lease[0] = take_lease(self.root)
            except OSError as exc:
                lease[1] = (f"checkpoint.dir={self.root} is not writable by this process: {exc}. Make it writable, "
                            "or point checkpoint.dir at a writable volume")
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(lease, src=0)
        if lease[1] is not None:
            raise PreflightError(lease[1])
        self.saver.attempt = lease[0]
        log.info("checkpoint.dir %s: this is attempt %d", self.root, lease[0])
        estimate = expected_checkpoint_bytes(self.state.model, ema=self.state.ema is not None)
        self.saver.expected_bytes = estimate
        if self.enabled:
            room = preflight_checkpoint_dir(self.root, estimate, self.ckpt_cfg.keep_last, self.rank,
                                            strict=self.ckpt_cfg.on_save_error == "stop")
            self.saver.expected_bytes = room.checkpoint_bytes
        if self.memory is not None:
            problem = self.memory.preflight(-(-estimate // self.world_size))
            if problem is not None and self.ckpt_cfg.memory.required:
                raise PreflightError(problem)
            if problem is not None:
                log.warning("%s. checkpoint.memory.required=false: training on the durable tier alone", problem)
                self.memory.disable()

    def resume(self, verify: Optional[VerifyHook] = None) -> str:
        """Load per checkpoint.resume; returns what happened, for the banner's 'resume:' field.

        With resume=auto a checkpoint that fails verification (checksums, or ``verify``) is
        marked bad and the next older committed one is tried.
        """
        spec = str(self.ckpt_cfg.resume)
        if self.memory is not None and self.memory.enabled and spec == "auto":
            resumed = self._resume_from_memory(verify)
            if resumed is not None:
                return resumed

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
                       load_s=round(time.perf_counter() - t0, 3), skipped=skipped, source="storage",
                       sources={str(r): "storage" for r in range(self.world_size)},
                       saved_world_size=manifest.world_size, saved_layout=manifest.layout)
        note = f" after skipping {', '.join(skipped)}" if skipped else ""
        return f"from {path} (step {manifest.step}, saved at world {manifest.world_size}){note}"

    def _resume_from_memory(self, verify: Optional[VerifyHook]) -> Optional[str]:
        """The memory tier first (checkpoint/memory/tier.py): the newest step every rank can get an
        intact copy of, newer than the newest durable checkpoint, verified like a durable load. None:
        go on to the durable tier (nothing usable, or the snapshot failed and was forgotten)."""
        t0 = time.perf_counter()
        newest = from_rank0(lambda: getattr(latest_committed(self.root), "path", None))
        restored = self.memory.restore(self.state, newer_than=parse(newest.name)[0] if newest is not None else 0)
        if restored is None:
            return None
        problem = self.memory.agree(restored.problem)
        where = self.memory.dir / STEP_DIR.format(restored.step)
        if problem is None and verify is not None:
            problem = self.memory.agree(verify(restored.manifest, where))
        if problem is not None:
            self.memory.forget(restored.step)
            log.error("the memory snapshot of step %d failed to load or verify: %s; falling back to the durable tier",
                      restored.step, problem)
            self.log_event(restored.step, kind="memory_restore_failed", problem=problem[:2000])
            if newest is None:
                raise CheckpointError(
                    f"the memory snapshot of step {restored.step} failed to load or verify ({problem}) and "
                    f"{self.root} has no committed checkpoint to fall back to; the live state is partly overwritten, "
                    "so this attempt stops. The snapshot is forgotten: a restart starts afresh")
            return None
        self._record_memory_resume(restored, time.perf_counter() - t0)
        sources = ", ".join(f"rank {r} {s}" for r, s in sorted(restored.sources.items()))
        return f"from the memory tier (step {restored.step}; {sources})"

    def _record_memory_resume(self, restored: Restored, seconds: float) -> None:
        log.info("resumed step %d from the memory tier in %.2f s (%s): %s", restored.step, seconds,
                 ", ".join(f"{k} {v:.2f} s" for k, v in restored.timings.items()),
                 ", ".join(f"rank {r} {s}" for r, s in sorted(restored.sources.items())))
        self.log_event(restored.step, kind="resume", checkpoint_id=checkpoint_id(restored.step),
                       path=str(self.memory.dir / STEP_DIR.format(restored.step)), load_s=round(seconds, 3),
                       skipped=[], source="memory", sources={str(r): s for r, s in restored.sources.items()},
                       saved_world_size=self.world_size, saved_layout=dict(self.layout), **restored.timings)

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

    def collect(self) -> None:
        """Wait for the save in flight (if any); a failure of the storage is handled as after a step."""
        self._storage_guard(self.saver.wait)
        self._report()

    def wait(self) -> None:
        """Block until the save in flight (if any) is done on this rank, and report it (raises its failure)."""
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
        self.init_from = manifest.init_from  # a resumed run's weights descend from the same source
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
        save happens, gives the reason this save must not be marked verified (or None). A save
        the storage refused does not raise here (see the module docstring)."""
        if self.due(step):
            self._storage_guard(self.saver.wait)  # the previous save's outcome first
            if self.save_failure is None:  # with on_save_error=stop the run ends at this step: no new save
                self._storage_guard(lambda: self.save(step, loss, verified_gate() if verified_gate else None))
        else:
            self._storage_guard(self.saver.poll)
        if self.memory is not None and self.memory.due(step):
            manifest = self._manifest(step, loss)  # sets the state's metadata: before the state dict
            self.memory.snapshot(step, self.state.state_dict(), manifest)
        elif self.memory is not None:
            self.memory.poll()
        return self._report()

    def memory_records(self) -> List[SnapshotRecord]:
        """The memory snapshots finished since the last call (logged already)."""
        out, self._memory_records = self._memory_records, []
        return out

    def _storage_guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except CheckpointSaveError as exc:
            self._save_failed(exc)

    def _save_failed(self, exc: CheckpointSaveError) -> None:
        """A save the storage refused: an alarm (log, metrics.jsonl); with on_save_error=stop kept
        for ``raise_save_failure``."""
        stop = self.ckpt_cfg.on_save_error == "stop"
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = None
        if stop:  # the whole message ends the run (train.py prints it)
            log.error("%s; stopping (checkpoint.on_save_error=stop)", str(exc).splitlines()[0])
        else:
            log.error("checkpoint.on_save_error=continue, training goes on: %s", exc)
        self.log_event(exc.step, kind="alarm", check="checkpoint_save", action=self.ckpt_cfg.on_save_error,
                       checkpoint_id=checkpoint_id(exc.step), errno=exc.errno, directory=str(self.root),
                       free_bytes=free, checkpoint_bytes=self.saver.expected_bytes,
                       message=str(exc).splitlines()[0])
        if self.last_saved_step == exc.step:
            self.last_saved_step = None  # not saved: a preemption at this step saves again
        if stop and self.save_failure is None:
            self.save_failure = exc

    def raise_save_failure(self) -> None:
        """Every rank agreed that a save failed with on_save_error=stop: raise it here too (this
        rank's own copy of the failure, once its side of that save has finished)."""
        self._storage_guard(self.saver.wait)
        failure, self.save_failure = self.save_failure, None
        if failure is None:
            raise CheckpointError("a checkpoint save failed on another rank (its message is in that rank's log); "
                                  "stopping with checkpoint.on_save_error=stop")
        raise failure

    def record_eval(self, step: int, val_loss: float) -> None:
        """The validation loss after ``step``: a save of that step records it in its manifest."""
        self._eval = (step, val_loss)

    def save(self, step: int, loss: Optional[float], unverified_reason: Optional[str] = None) -> None:
        """Save now (preemption, the loop's due saves); ``unverified_reason``: not marked verified."""
        manifest = self._manifest(step, loss)
        if unverified_reason is not None:
            manifest.verified, manifest.unverified_reason = False, unverified_reason
            log.warning("checkpoint %s will not be marked verified: %s", manifest.checkpoint_id, unverified_reason)
        self.saver.save(self.state.state_dict(), manifest)
        self.last_saved_step = step

    def _manifest(self, step: int, loss: Optional[float]) -> Manifest:
        """The manifest of a save of ``step`` (durable or memory); sets the state's metadata to match.
        Runs the probe: post-load verification compares its loss."""
        probe_loss = self.probe() if self.probe is not None else None
        s = self.state
        s.meta = {"wall_clock": time.time(), "config_hash": self.config_hash, "world_size": self.world_size,
                  "layout": dict(self.layout), "global_batch_size": self.cfg.training.global_batch_size,
                  "loss": loss, "probe_loss": probe_loss}
        return Manifest(
            checkpoint_id=checkpoint_id(step), step=step, tokens=s.tokens, samples=s.samples,
            created_at=s.meta["wall_clock"], config_hash=self.config_hash, config=self.full_config,
            world_size=self.world_size, layout=dict(self.layout), init_from=self.init_from,
            global_batch_size=self.cfg.training.global_batch_size, loss=loss, probe_loss=probe_loss,
            checksum_algorithm=None, components=s.components(),
            val_loss=self._eval[1] if self._eval is not None and self._eval[0] == step else None)

    def close(self) -> None:
        """Wait for the in-flight save and for retention; report. A last save the storage refused
        raises here with on_save_error=stop (an alarm either way)."""
        try:
            if self.memory is not None:
                self.memory.close()
            self._storage_guard(self.saver.close)
            self._report()
        finally:
            self._housekeeping.shutdown(wait=True)
        if self.save_failure is not None:
            failure, self.save_failure = self.save_failure, None
            raise failure

    # -- helpers ---------------------------------------------------------------------------
    def _after_commit(self, manifest: Manifest) -> None:
        self.saver.expected_bytes = manifest.total_bytes  # the size the messages of failed saves quote
        self._housekeeping.submit(self._retention, manifest.step)

    def _retention(self, step: int) -> None:
        c = self.ckpt_cfg
        try:
            check_lease(self.root, self.saver.attempt)  # an older attempt's writer deletes nothing
            apply_retention(self.root, c.keep_last, c.keep_every, c.keep_best, c.best_metric,
                            fault_hook=self.saver.fault_hook)
        except Exception:  # retention must never stop training; the next commit retries
            log.exception("retention after step %d failed", step)

    def discard_memory(self) -> None:
        """Delete the memory tier's snapshots on this node: the run reached training.steps (they would only
        hold memory), or a rollback abandoned the trajectory they hold (a restart must not return to it)."""
        if self.memory is not None:
            self.memory.discard()

    def _report(self) -> List[SaveRecord]:
        records = self.saver.finished()
        for r in records:
            self._record(r)
        if self.memory is not None:
            for m in self.memory.finished():
                self._record_snapshot(m)
        return records

    def _record_snapshot(self, r: SnapshotRecord) -> None:
        self._memory_records = (self._memory_records + [r])[-16:]  # read by checkpoint.memory.interval=auto
        log.debug("memory snapshot of step %d: stalled training %.3f s, background %.3f s (replica %.3f s), "
                  "%.1f MiB%s", r.step, r.stall_s, r.background_s, r.replica_s, r.bytes / 2**20,
                  ", complete" if r.committed else ", NOT complete")
        self.log_event(r.step, kind="memory_snapshot", stall_s=round(r.stall_s, 4), waited_s=round(r.waited_s, 4),
                       background_s=round(r.background_s, 4), replica_s=round(r.replica_s, 4), bytes=r.bytes,
                       replica_bytes=r.replica_bytes, committed=r.committed)

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
