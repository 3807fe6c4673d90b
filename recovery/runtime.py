"""Recovery around the training loop, behind a handful of calls so train.py stays a recipe.

    rt = RecoveryRuntime(cfg, run_dir, world)           # faults armed, watchdog and signals on
    resumed = rt.resume(ckpt, state, probe, dims, plan)  # verified resume with bounded fallback
    rt.phase("data_wait", step)                          # heartbeat + fault injection point
    if rt.after_step(step, seconds, ckpt, loss): break   # stragglers, write watch, preemption
    rt.close()
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from recovery import faults
from recovery.preemption import Preemption
from recovery.stragglers import StragglerMonitor
from recovery.watchdog import Watchdog

log = logging.getLogger("trainer")


class RecoveryRuntime:
    def __init__(self, cfg, run_dir: Path, world):
        rc = cfg.recovery
        self.cfg, self.world = cfg, world
        faults.configure(OmegaConf.to_container(rc.faults, resolve=True), run_dir, world.rank)
        self.watchdog: Optional[Watchdog] = None
        if rc.watchdog:
            self.watchdog = Watchdog(run_dir, world.rank, dict(rc.timeouts), rc.checkpoint_write_timeout_s).start()
        self.preemption = Preemption(list(rc.preemption_signals), rc.preemption_grace_s).install()
        self.stragglers = StragglerMonitor(rc.straggler_interval, rc.straggler_factor)
        self._first_step_done = False
        self._writing: Optional[int] = None  # step of the background write in flight
        self._write_started = 0.0
        self.auto_interval = AutoInterval(cfg, world.world_size) if str(cfg.checkpoint.interval).strip() == "auto" \
            else None
        self._save_started: Optional[float] = None

    # -- heartbeats and injection points ---------------------------------------------------
    def beat(self, phase: str, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase, step)

    def phase(self, phase: str, step: int, model=None) -> None:
        """Enter ``phase`` of 1-based ``step``: beat, then let a configured fault fire."""
        if phase == "step" and not self._first_step_done:
            self.beat("first_step", step)
        else:
            self.beat(phase, step)
        faults.maybe_inject(phase, step, model=model)

    # -- resume --------------------------------------------------------------------------
    def resume(self, ckpt, state, probe, dims, plan) -> str:
        """checkpoint.resume with post-load verification, bounded fallback, elastic batch log."""
        from recovery.verify import ResumeVerifier, refuse_all_bad

        self.beat("checkpoint_load", state.step)
        if str(self.cfg.checkpoint.resume) == "auto":
            refuse_all_bad(Path(self.cfg.checkpoint.dir))
        verifier = None
        if self.cfg.recovery.verify:
            verifier = ResumeVerifier(self.cfg, state, probe, {k: getattr(dims, k) for k in
                                      ("dp_replicate", "dp_shard", "tp")}, self.world.world_size, self.world.device)
        t0 = time.perf_counter()
        resumed = ckpt.resume(verify=verifier)
        if state.step > 0:
            log_elastic(ckpt, state, plan, self.world.world_size)
            log.info("resume took %.2f s (load + verification)", time.perf_counter() - t0)
        return resumed

    # -- after every step ----------------------------------------------------------------
    def before_checkpoint(self, ckpt, step: int) -> None:
        if ckpt.due(step):
            self.beat("checkpoint_snapshot", step)
            self._save_started = time.perf_counter()

    def after_step(self, step: int, step_s: float, ckpt, loss: float) -> bool:
        """Bookkeeping after step ``step`` (1-based) and its checkpoint; True: stop now (preempted)."""
        if self.auto_interval is not None:
            blocking = time.perf_counter() - self._save_started if self._save_started is not None else None
            self.auto_interval.record(step, step_s, blocking, first=not self._first_step_done)
        self._save_started = None
        self._first_step_done = True
        self.beat("step", step)
        self._watch_write(ckpt, step)
        if self.auto_interval is not None:
            self.auto_interval.maybe_choose(ckpt, step, self._writing is not None)
        self.stragglers.record(step, step_s)
        if not self.preemption.should_stop():
            return False
        self._save_before_exit(ckpt, step, loss)
        return True

    def _watch_write(self, ckpt, step: int) -> None:
        """Give each background write its own timer. A new save collects the previous one first,
        so back-to-back saves can stay "in flight" across steps: key the timer by the saved step."""
        saving = ckpt.last_saved_step if ckpt.saver.in_flight else None
        if saving == self._writing:
            return
        if self._writing is not None and saving is None and self.auto_interval is not None:
            self.auto_interval.write_s = time.perf_counter() - self._write_started
        self._writing = saving
        if saving is not None:
            self._write_started = time.perf_counter()
        if self.watchdog is not None:
            if saving is None:
                self.watchdog.write_done()
            else:
                future = getattr(ckpt.saver, "_in_flight", None)  # the saver's background Future
                self.watchdog.write_started(saving, future.done if future is not None else None)

    def _save_before_exit(self, ckpt, step: int, loss: float) -> None:
        pre = self.preemption
        left = pre.seconds_left()
        log.warning("preemption (%s): saving step %d, %.0f s of the %.0f s grace period left", pre.signal_name,
                    step, left, pre.grace_s)
        if self.watchdog is not None:  # a save that cannot commit within the grace period is abandoned
            self.watchdog.timeouts["shutdown"] = max(1.0, left)
            self.beat("shutdown", step)
        t0 = time.perf_counter()
        if ckpt.last_saved_step != step:
            ckpt.save(step, loss)
        ckpt.saver.wait()  # committed (coordinator) before anyone exits
        self._writing = None
        if self.watchdog is not None:
            self.watchdog.write_done()
        log.warning("preemption: step %d committed in %.2f s; exiting cleanly", step, time.perf_counter() - t0)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.preemption.uninstall()

    @property
    def preempted(self) -> bool:
        return self.preemption.requested_at is not None


class AutoInterval:
    """checkpoint.interval=auto: measure, then set the Young/Daly interval once (logged).

    The manager takes a first save after AUTO_MEASURE_STEPS steps; its blocking time C is
    what the training thread waited, its write time W (async) lasts until the background
    write is collected. With the median step time (first step excluded) and the job's MTBF
    (recovery.device_mtbf_hours / devices) the interval is chosen and never revisited.
    """

    def __init__(self, cfg, world_size: int):
        from recovery.interval import cluster_mtbf_s

        self.cfg = cfg
        self.mtbf_s = cluster_mtbf_s(cfg.recovery.device_mtbf_hours, cfg.recovery.devices or world_size)
        self.step_times: list = []
        self.blocking_s: Optional[float] = None
        self.write_s: Optional[float] = None
        self.sync = cfg.checkpoint.async_mode == "sync"
        self.chosen = None

    def record(self, step: int, step_s: float, blocking_s: Optional[float], first: bool) -> None:
        if not first:
            self.step_times.append(step_s)
        if blocking_s is not None and self.blocking_s is None:
            self.blocking_s = blocking_s
            if self.sync:
                self.write_s = 0.0

    def maybe_choose(self, ckpt, step: int, writing: bool) -> None:
        import statistics

        from recovery.interval import choose_interval_steps

        if self.chosen is not None or self.blocking_s is None or self.write_s is None or writing or not self.step_times:
            return
        step_s = statistics.median(self.step_times)
        self.chosen = choose_interval_steps(step_s, self.blocking_s, self.write_s, self.mtbf_s,
                                            max_steps=self.cfg.training.steps)
        ckpt.interval = self.chosen.steps
        log.info("checkpoint.interval=auto: every %d steps (%s)", self.chosen.steps, self.chosen.reason)
        if ckpt.metrics is not None:
            ckpt.metrics.log_event(step, kind="checkpoint_interval", interval_steps=self.chosen.steps,
                                   step_s=step_s, blocking_s=self.blocking_s, write_s=self.write_s,
                                   mtbf_s=self.mtbf_s, optimum_s=self.chosen.optimum_s)


def log_elastic(ckpt, state, plan, world_size: int) -> None:
    """Say how a resume at another world size keeps the global batch (contract 5)."""
    meta = state.meta or {}
    saved_world = meta.get("world_size", world_size)
    saved_layout = meta.get("layout", {})
    saved_dp = saved_layout.get("dp_replicate", 1) * saved_layout.get("dp_shard", 1) if saved_layout else None
    if saved_world == world_size:
        return
    old_accum = (plan.global_batch_size // (saved_dp * plan.micro_batch_size)
                 if saved_dp and plan.global_batch_size % (saved_dp * plan.micro_batch_size) == 0 else "?")
    log.warning("elastic resume: checkpoint saved at world %d (dp %s, grad_accum_steps %s), now world %d "
                "(dp %d): grad_accum_steps recomputed to %d so the global batch stays %d sequences "
                "(%d x micro %d x accum %d)", saved_world, saved_dp, old_accum, world_size, plan.dp_size,
                plan.grad_accum_steps, plan.global_batch_size, plan.dp_size, plan.micro_batch_size,
                plan.grad_accum_steps)
