"""The facade the training run calls: preflight, load, save when due, close.

Ties the parts together: TrainingState (what, checkpoint/state/), the durable tier's saver, loader and
retention (checkpoint/durable/), the memory tier (checkpoint/memory/). It builds each save's manifest
(what post-load verification compares: config hash, layout, losses, the probe loss; the validation loss
of an evaluation at that step; the weights' pretrained source) and reports each save (a log line, a
metrics.jsonl record). Which checkpoint to resume from, and the fallback when one fails, are recovery's
decisions (recovery/resume.py); recovery/runtime.py drives this class through its public methods.

A save the storage refused (CheckpointSaveError: disk full, read-only, over quota) is an
alarm in metrics.jsonl either way; ``checkpoint.on_save_error=continue`` trains on (the next
interval tries again), ``stop`` keeps it in ``save_failure`` until recovery/runtime.py has
agreed with the other ranks on the step to stop at, then ``raise_save_failure`` raises it.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from checkpoint.config import AUTO_MEASURE_STEPS, CheckpointConfig
from checkpoint.durable.discovery import apply_retention, checkpoint_id
from checkpoint.durable.lease import check_lease
from checkpoint.durable.loader import load_checkpoint
from checkpoint.durable.manifest import (
    LOAD_ERRORS,
    NEXT_MICRO_BATCH,
    CheckpointError,
    ConfigMismatch,
    Manifest,
    VerificationFailed,
    default_algorithm,
    read_manifest,
)
from checkpoint.durable.preflight import (
    PreflightError,
    expected_checkpoint_bytes,
    held_once,
    preflight_checkpoint_dir,
    shared_staging_problem,
)
from checkpoint.durable.saver import CheckpointSaveError, CheckpointSaver, FaultHook, SaveRecord
from checkpoint.state.fingerprint import config_differences, config_hash, hashed_config, schedule_changes
from checkpoint.state.training_state import TrainingState
from checkpoint.storage import location
from data.batching import SampleRange
from parallel import collectives

log = logging.getLogger("trainer")

# A post-load check (recovery): returns None when the loaded state is good, else the reason.
VerifyHook = Callable[[Manifest, Path], Optional[str]]


class CheckpointManager:
    def __init__(self, c: CheckpointConfig, state: TrainingState, *, config: Dict, global_batch_size: int,
                 steps: int, seed: int, run_name: str, retries: Tuple[int, float], rank: int, world_size: int,
                 layout: Dict[str, int], device: torch.device, metrics=None,
                 probe: Optional[Callable[[], float]] = None, fault_hook: Optional[FaultHook] = None):
        """``c``: the checkpoint section; ``config``: the run's resolved config, which every manifest records
        (and hashes); ``steps``: training.steps (the final save); ``seed``: the run's (a load restores RNG
        from it where a checkpoint holds none); ``retries``: recovery.read_retries and read_retry_backoff_s
        (a read of shared storage that decides for every rank: checkpoint/durable/reads.py)."""
        self.cfg, self.state = c, state
        self.rank, self.world_size, self.device = rank, world_size, device
        self.steps, self.seed, self.retries = steps, seed, retries
        self.layout = dict(layout)
        self.root = location(c.dir)  # a folder, or an s3:// prefix (checkpoint/storage/)
        # "auto": recovery/runtime.py measures a first save, then calls set_interval (Young/Daly)
        self.interval = AUTO_MEASURE_STEPS if c.every == "auto" else c.every
        self.full_config, self.global_batch_size, self.probe = config, global_batch_size, probe
        self.hashed = hashed_config(config)
        self.config_hash = config_hash(self.hashed)
        self.init_from: Optional[Dict] = None  # every manifest's init_from (checkpoint/interop/init_from.py)
        self._eval: Optional[Tuple[int, float]] = None  # (step, validation loss) of the latest evaluation
        self.metrics = metrics  # a MetricsLogger (metrics/logger.py), or None: log lines only
        self.fault_hook = fault_hook  # the saver's phases, and checkpoint_read while loading
        self._housekeeping = futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-retention")
        group = None
        if collectives.distributed() and world_size > 1:
            # Own gloo group: DCP's collectives (from a background thread in async mode) must not
            # interleave with training collectives on the default group.
            group = collectives.new_gloo_group(c.commit_timeout_s)
        self.saver = CheckpointSaver(
            self.root, c.async_mode, rank, world_size, process_group=group,
            checksum_algorithm=default_algorithm() if c.checksum else None,
            commit_timeout_s=c.commit_timeout_s, pin_memory=device.type == "cuda",
            after_commit=self._after_commit, fault_hook=fault_hook, storage_format=c.format)
        self.memory = None  # the memory tier (checkpoint/memory/), when checkpoint.memory turns it on
        if c.memory.enabled:  # unit: memory (its code is loaded only by a run that turns it on)
            from checkpoint.memory.tier import MemoryTier
            self.memory = MemoryTier.of(c.memory, self, run_name)
        self.last_saved_step: Optional[int] = None
        # Whether this process writes the step's durable checkpoint: always, but for replica groups sharing
        # checkpoint.dir, where the step's quorum names one group (recovery/fault_tolerance.py)
        self.writes: Callable[[], bool] = lambda: True
        self._next_probe: Optional[Tuple[SampleRange, Future]] = None  # a save's probe the next step brings
        self.save_failure: Optional[CheckpointSaveError] = None  # on_save_error=stop: raised once agreed

    def record_eval(self, step: int, val_loss: float) -> None:
        """The validation loss after ``step``: a save of that step records it in its manifest."""
        self._eval = (step, val_loss)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def set_interval(self, steps: int) -> None:
        """Save every ``steps`` steps from now on (checkpoint.interval=auto decides it at run time)."""
        if steps < 1:
            raise ValueError(f"checkpoint interval {steps} must be >= 1")
        self.interval = int(steps)

    # -- before step 1 -------------------------------------------------------------------
    def preflight(self, attempt: int, lease_root=None) -> None:
        """Before resume, with this attempt's lease taken (trainer/preflight.py; ``lease_root``: where, when not
        checkpoint.dir itself): room for the saves to come
        (checkpoint/durable/preflight.py), in /dev/shm for async_process's staging, and in the memory tier's
        root. Each rank checks, and all agree: one rank short of room stops (or turns the tier off on) all."""
        self.saver.attempt = attempt  # a writer of an older attempt stops before it commits
        self.saver.lease_root = self.root if lease_root is None else location(lease_root)
        log.info("checkpoint.dir %s: this is attempt %d", self.root, attempt)
        estimate = expected_checkpoint_bytes(self.state.model, ema=self.state.ema is not None)
        rank_bytes = expected_checkpoint_bytes(self.state.model, ema=self.state.ema is not None, local=True)
        self.saver.expected_bytes = estimate
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        staging = rank_bytes * local_ranks if self.enabled and self.cfg.async_mode == "async_process" else 0
        problem = None  # every rank checks its own access; all stop if one cannot write
        if self.enabled:
            try:
                held = held_once(self.root, estimate, *self.retries)  # rank 0 lists
                room = preflight_checkpoint_dir(self.root, estimate, self.cfg.keep_last, self.rank,
                                                self.cfg.on_save_error == "stop", held)
                self.saver.expected_bytes = room.checkpoint_bytes
            except PreflightError as exc:
                problem = str(exc)
            if problem is None and staging:  # async_process stages in each node's /dev/shm
                problem = shared_staging_problem(rank_bytes, local_ranks)
        problem = collectives.agree_on_problems(problem)
        if problem is not None:
            raise PreflightError(problem)
        if self.memory is not None:  # each node measures its own memory; every rank takes the same decision
            self.memory.agreed_preflight(rank_bytes, staging)  # this rank's shards (HSDP: a replica's too)

    def collect(self) -> None:
        """Wait for the save in flight (if any); a failure of the storage is handled as after a step."""
        self._settle_probe()
        self._storage_guard(self.saver.wait)
        self._report()

    def wait(self) -> None:
        """Block until the save in flight (if any) is done on this rank, and report it (raises its failure)."""
        self._settle_probe()
        self.saver.wait()
        self._report()

    def wait_for_retention(self, poll_s: Optional[float] = None) -> None:
        """Until the retention queued so far is done (rank 0 runs it; it may be deleting terabytes): a
        rollback must not choose a directory it renames. Every rank waits, agreeing every ``poll_s``
        (collectives.AGREED_POLL_S) whether rank 0 is still at it, so no rank sits in a collective longer
        than that."""
        done = self._housekeeping.submit(lambda: None)
        collectives.wait_for_rank0(lambda timeout_s: not futures.wait([done], timeout=timeout_s).not_done, poll_s)

    @property
    def writing(self) -> Optional[Tuple[int, Callable[[], bool]]]:
        """(step, is_done) of the background write in flight, or None. ``is_done`` is thread-safe. None too while
        the save waits for its probe from the next step: the watchdog's write timer (recovery/runtime.py) starts
        once that step has run, so a hang of the training thread meanwhile is the step timer's, not the write's."""
        return None if self._next_probe is not None else self.saver.in_flight

    def load(self, path: Path, verify: Optional[VerifyHook] = None) -> Manifest:
        """Load the committed checkpoint at ``path`` into the state (every rank together), then run
        ``verify``; raises CheckpointError (damaged, or failed verification on any rank) or
        ConfigMismatch (saved with another config, not allowed by checkpoint.allow_config_change)."""
        manifest = collectives.decided_on_rank0(lambda: read_manifest(path), errors=LOAD_ERRORS)  # one reader
        changed = schedule_changes(manifest.config, self.full_config)
        if changed:
            log.warning("resume changes the schedule (this run's config applies from step %d on): %s",
                        manifest.step, "; ".join(changed))
        if manifest.config_hash != self.config_hash:
            diffs = config_differences(hashed_config(manifest.config), self.hashed)
            msg = (f"{path} was saved with a different config (hash {manifest.config_hash}, this run "
                   f"{self.config_hash}): {'; '.join(diffs) or 'unknown fields'}")
            if not self.cfg.allow_config_change:
                raise ConfigMismatch(msg + ". Resume with the same settings, or set "
                                     "checkpoint.allow_config_change=true to accept the change.")
            log.warning("checkpoint.allow_config_change=true: %s", msg)
        t0 = time.perf_counter()
        fault = (lambda f: self.fault_hook("checkpoint_read", manifest.step, path=f)) if self.fault_hook else None
        manifest = load_checkpoint(self.state, path, seed=self.seed, verify=self.cfg.verify_on_load,
                                   threads=self.cfg.load_threads, manifest=manifest, fault=fault)
        log.info("loaded %s in %.2f s", path, time.perf_counter() - t0)
        self.init_from = manifest.init_from  # a resumed run's weights descend from the same source
        problem = verify(manifest, path) if verify is not None else None
        if collectives.any_rank(problem is not None):
            raise VerificationFailed(f"{path} failed post-load verification: {problem or 'on another rank'}")
        return manifest

    # -- the loop ----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if not self.enabled or not self.writes():
            return False
        return step % self.interval == 0 or (self.cfg.save_final and step == self.steps)

    def after_step(self, step: int, loss: float, verified_gate: Optional[Callable[[], Optional[str]]] = None,
                   probe_from_next_step: bool = False) -> List[SaveRecord]:
        """Call after every optimizer step (1-based ``step``): saves when due; returns the records of the
        saves finished since the last call. ``verified_gate()``, asked only when a save happens, gives the
        reason it must not be marked verified (or None). ``probe_from_next_step``: the loop runs another step
        and hands its first micro-batch's loss to ``took_step``: an async save takes it as its probe instead of
        running one. A save the storage refused does not raise here."""
        if self.due(step):
            self._settle_probe()
            self._storage_guard(self.saver.wait)  # the previous save's outcome first
            if self.save_failure is None:  # with on_save_error=stop the run ends at this step: no new save
                self._storage_guard(lambda: self.save(step, loss, verified_gate() if verified_gate else None,
                                                      probe_from_next_step))
        else:
            self._storage_guard(self.saver.poll)
        if self.memory is not None:
            self.memory.after_step(step, loss, self)
        return self._report()

    def _storage_guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except CheckpointSaveError as exc:
            self._save_failed(exc)

    def _save_failed(self, exc: CheckpointSaveError) -> None:
        """A save the storage refused: an alarm (log, metrics.jsonl); with on_save_error=stop kept
        for ``raise_save_failure``."""
        action = self.cfg.on_save_error
        try:
            free = self.root.free_bytes()
        except OSError:
            free = None
        if action == "stop":  # the whole message ends the run (train.py prints it)
            log.error("%s; stopping (checkpoint.on_save_error=stop)", str(exc).splitlines()[0])
        else:
            log.error("checkpoint.on_save_error=continue, training goes on: %s", exc)
        self.log_event(exc.step, kind="alarm", check="checkpoint_save", action=action,
                       checkpoint_id=checkpoint_id(exc.step), errno=exc.errno, directory=str(self.root),
                       free_bytes=free, checkpoint_bytes=self.saver.expected_bytes, message=str(exc).splitlines()[0])
        if self.last_saved_step == exc.step:
            self.last_saved_step = None  # not saved: a preemption at this step saves again
        if action == "stop" and self.save_failure is None:
            self.save_failure = exc

    def raise_save_failure(self) -> None:
        """Every rank agreed that a save failed with on_save_error=stop: raise it here too (this
        rank's own copy of the failure, once its side of that save has finished)."""
        self._settle_probe()
        self._storage_guard(self.saver.wait)
        failure, self.save_failure = self.save_failure, None
        if failure is None:
            raise CheckpointError("a checkpoint save failed on another rank (its message is in that rank's log); "
                                  "stopping with checkpoint.on_save_error=stop")
        raise failure

    def save(self, step: int, loss: Optional[float], unverified_reason: Optional[str] = None,
             probe_from_next_step: bool = False) -> None:
        """Save now (preemption, the loop's due saves); ``unverified_reason``: not marked verified;
        ``probe_from_next_step``: as ``after_step``'s."""
        started = time.perf_counter()  # the probe (in the manifest's build) counts in the blocking time
        self._settle_probe()
        deferred = probe_from_next_step and self._probe_deferrable()
        samples = self.probe.next_micro_batch() if deferred else None
        manifest = self.build_manifest(step, loss, NEXT_MICRO_BATCH if deferred else None, samples)
        if unverified_reason is not None:
            manifest.verified, manifest.unverified_reason = False, unverified_reason
            log.warning("checkpoint %s will not be marked verified: %s", manifest.checkpoint_id, unverified_reason)
        probe_loss = Future() if deferred else None
        self.saver.save(self.state.state_dict(), manifest, started, probe_loss)
        if deferred:
            self._next_probe = (samples, probe_loss)
        self.last_saved_step = step

    def _probe_deferrable(self) -> bool:
        """Whether a save may take the next step's loss as its probe: a background commit (async modes), a
        probe that can (no dropout), and checkpoints not ranked by probe loss (the fixed batch compares them).
        Config only: the same on every rank."""
        return (self.cfg.async_mode != "sync" and self.probe is not None and getattr(self.probe, "deferrable", False)
                and self.cfg.best_metric != "probe_loss")

    def took_step(self, first_loss: Optional[torch.Tensor]) -> None:
        """After the step that follows a save with a deferred probe (every rank, right after its update):
        ``first_loss``, the summed loss of this rank's first micro-batch (training/step.py), completes the
        save's manifest. On rank 0 that micro-batch is the probe's samples; other ranks' commits take none. The
        host reads it on the saver's thread, so the step after a save adds no host sync."""
        if self._next_probe is None:
            return
        (samples, future), self._next_probe = self._next_probe, None
        future.set_result(first_loss / self.state.data.dataset.target_count(samples))  # the commit reads it

    def _abandon_or_settle_probe(self) -> None:
        """``close``'s treatment of a deferred probe (its docstring says which)."""
        if self._next_probe is None:
            return
        if self.world_size == 1:
            try:
                self._settle_probe()
                return
            except Exception as exc:  # noqa: BLE001 - the error that ended the run may have broken the model too
                log.warning("the probe of the checkpoint of step %s could not be computed: %s", self.last_saved_step,
                            exc)
        log.warning("checkpoint of step %s is left uncommitted: the run stopped before the step that brings "
                    "its probe", self.last_saved_step)
        self._next_probe[1].cancel()
        self._next_probe = None

    def _settle_probe(self) -> None:
        """A deferred probe whose step has not come (a save or wait before it: preemption, a direct caller): run
        it now, on the saved weights (no step since). Every rank calls this at the same point (collectives)."""
        if self._next_probe is not None:
            samples, future = self._next_probe
            value = self.probe.of_samples(samples)  # if it raises, the save stays pending (close abandons it)
            self._next_probe = None
            future.set_result(value)

    def close(self) -> None:
        """Wait for the in-flight save and for retention; report. A last save the storage refused
        raises here with on_save_error=stop (an alarm either way). A save still waiting for the next step's
        probe (the run stops on an error before that step; the normal paths settle it first) commits in a
        one-rank run, whose probe runs no collective (the weights are the saved ones: no step came); with
        more ranks it is left uncommitted, since on an error's way out no rank may run a collective the others
        are not in."""
        self._abandon_or_settle_probe()
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
    def build_manifest(self, step: int, loss: Optional[float], probe_method: Optional[str] = None,
                       probe_samples: Optional[SampleRange] = None) -> Manifest:
        """The manifest of a save of ``step``; sets the state's metadata to match (before its state dict is
        taken). Runs the probe, whose loss post-load verification compares, unless ``probe_method`` names
        another proof of the weights (the memory tier's: checkpoint/memory/snapshot.py) or one that comes
        later (NEXT_MICRO_BATCH, of ``probe_samples``: the saver fills it in)."""
        probe_loss = self.probe() if self.probe is not None and probe_method is None else None
        later = probe_method == NEXT_MICRO_BATCH
        s, gbs = self.state, self.global_batch_size
        s.meta = {"wall_clock": time.time(), "config_hash": self.config_hash, "world_size": self.world_size,
                  "layout": dict(self.layout), "global_batch_size": gbs, "loss": loss, "probe_loss": probe_loss}
        return Manifest(
            checkpoint_id=checkpoint_id(step), step=step, tokens=s.tokens, samples=s.samples,
            created_at=s.meta["wall_clock"], config_hash=self.config_hash, config=self.full_config,
            world_size=self.world_size, layout=dict(self.layout), init_from=self.init_from,
            global_batch_size=gbs, loss=loss, probe_loss=probe_loss, checksum_algorithm=None,
            probe_method=probe_method or (getattr(self.probe, "method", None) if probe_loss is not None else None),
            probe_kernels=getattr(self.probe, "kernels", None) if probe_loss is not None or later else None,
            probe_samples=[probe_samples.start, probe_samples.count] if later else None,
            components=s.components(),
            val_loss=self._eval[1] if self._eval is not None and self._eval[0] == step else None)

    def _after_commit(self, manifest: Manifest) -> None:
        self.saver.expected_bytes = manifest.total_bytes  # the size the messages of failed saves quote
        self._housekeeping.submit(self._retention, manifest.step)

    def _retention(self, step: int) -> None:
        c = self.cfg
        try:
            check_lease(self.saver.lease_root, self.saver.attempt)  # an older attempt's writer deletes nothing
            apply_retention(self.root, c.keep_last, c.keep_every, c.keep_best, c.best_metric,
                            fault_hook=self.saver.fault_hook, keep_forensic=c.keep_forensic)
        except OSError as exc:  # the storage did not answer: one line, not a traceback
            log.warning("retention after step %d failed (the next commit retries): %s", step, exc)
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
            log.info("checkpoint %s (%s): blocked training %.3f s (%.3f s waiting for the previous save), "
                     "background %.3f s, %.1f MiB%s", r.checkpoint_id, r.mode, r.blocking_s, r.waited_s,
                     r.background_s, r.bytes / 2**20, ", committed" if r.committed else "")
            self.log_event(r.step, kind="checkpoint", checkpoint_id=r.checkpoint_id, mode=r.mode,
                           blocking_s=r.blocking_s, waited_s=r.waited_s, background_s=r.background_s,
                           bytes=r.bytes, committed=r.committed)
        if self.memory is not None:
            self.memory.report()
        return records

    def log_event(self, step: int, **fields) -> None:
        """A record in metrics.jsonl (rank 0), e.g. a resume or a rollback."""
        if self.metrics is not None:
            self.metrics.log_event(step, **fields)
