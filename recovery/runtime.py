"""Recovery around the training loop, behind a handful of calls so the loop stays a recipe.

    rt = RecoveryRuntime(config.recovery, run_dir, world, ckpt, guards, injector, optim=..., steps=...)
    resumed = rt.resume(state, probe, dims, plan)    # verified resume with bounded fallback
    rt.phase("data_wait", step)                      # heartbeat + fault injection point
    rt.inject("gradients", step, model=model)        # the gradients fault point, before the norms
    rt.allow_update(step, stats)                     # the guards' veto on the step's loss and norms
    back = rt.step_boundary(step, data)              # the guards' checks; a rollback's step, or None
    train_step(..., step_flags=rt.step_flags)        # the flags ride the step's reduction
    if rt.end_of_step(step, seconds, result): break  # save when due, write watch, stragglers, preemption
    rt.close()

What it drives is here too: preemption, the straggler report and checkpoint.interval=auto.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from checkpoint.durable.reads import read_on_rank0
from checkpoint.durable.saver import SaveRecord
from parallel import collectives
from parallel.dims import data_parallel_size
from recovery.config import RecoveryConfig
from recovery.faults import FaultInjector
from recovery.interval import choose_interval_steps, cluster_mtbf_s
from recovery.resume import resume
from recovery.verify import RecoveryError, ResumeVerifier, refuse_all_bad
from recovery.watchdog import Watchdog

log = logging.getLogger("trainer")


class RecoveryRuntime:
    def __init__(self, rc: RecoveryConfig, run_dir: Path, world, ckpt, guards, injector: FaultInjector, *, optim,
                 steps: int):
        """``rc``: the recovery section; ``guards``: None without them; ``optim`` and ``steps`` (training.steps):
        the schedule a resumed run's LR is checked against; the checkpoint section is the manager's (``ckpt.cfg``)."""
        self.cfg, self.world, self.ckpt, self.guards = rc, world, ckpt, guards
        self.optim, self.steps = optim, steps
        self.faults = injector
        self.watchdog: Optional[Watchdog] = None
        if rc.watchdog:
            self.watchdog = Watchdog(run_dir, world.rank, dict(rc.timeouts), rc.checkpoint_write_timeout_s).start()
        self.preemption = Preemption(list(rc.preemption_signals), rc.preemption_grace_s).install()
        problem = torchrun_grace_problem(rc.preemption_grace_s)
        if problem and world.rank == 0:
            log.warning("%s", problem)
        self.stragglers = StragglerMonitor(rc.straggler_interval, rc.straggler_factor)
        self._first_step_done = False
        self._writing: Optional[int] = None  # step of the background write the watchdog times
        self.autos: List[AutoInterval] = []  # checkpoint.interval=auto, then the memory tier's
        if ckpt.cfg.every == "auto":
            self.autos.append(AutoInterval(rc, steps, world.world_size))
        if ckpt.memory is not None and ckpt.memory.auto:
            self.autos.append(AutoInterval(rc, steps, world.world_size, tier="memory"))

    # -- heartbeats and injection points ---------------------------------------------------
    def beat(self, phase: str, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(phase, step)

    def inject(self, phase: str, step: int, model=None, path=None) -> None:
        """The run's one fault-injection point (also the checkpoint saver's ``fault_hook``)."""
        self.faults.maybe_inject(phase, step, model=model, path=path)

    def phase(self, phase: str, step: int, model=None) -> None:
        """Enter ``phase`` of 1-based ``step``: beat, then let a configured fault fire."""
        if phase == "step" and not self._first_step_done:
            self.beat("first_step", step)
        else:
            self.beat(phase, step)
        self.inject(phase, step, model=model)

    def allow_update(self, step: int, stats) -> bool:
        """Between backward and the update of 1-based ``step``: False skips the update (guards).
        ``stats``: the step's loss and layer norms (training/grad_stats.py StepStats)."""
        if self.guards is None:
            return True
        return self.guards.allow_update(step, stats.loss, stats.layer_norms)

    # -- resume and rollback ------------------------------------------------------------
    def resume(self, state, probe, dims, plan) -> str:
        """checkpoint.resume with post-load verification, bounded fallback, elastic batch log."""
        self.beat("checkpoint_load", state.step)
        if str(self.ckpt.cfg.resume) == "auto":  # one listing, on rank 0; its verdict on every rank
            root = self.ckpt.root
            read_on_rank0(lambda: refuse_all_bad(root), f"checkpoint.dir={root}", *self.ckpt.retries,
                          errors=(RecoveryError,))
        verifier = None
        if self.cfg.verify:
            verifier = ResumeVerifier(self.cfg, self.optim, self.steps, self.ckpt, state, probe, dims.layout,
                                      self.world.world_size, inject=self.inject)
        t0 = time.perf_counter()
        resumed = resume(self.ckpt, verifier)
        if state.step > 0:
            log_elastic(state, plan, self.world.world_size)
            log.info("resume took %.2f s (load + verification)", time.perf_counter() - t0)
        return resumed

    def step_boundary(self, step: int, data) -> Optional[int]:
        """After the update of 1-based ``step``: the guards' periodic checks; the step to go on from when they
        rolled back to a verified checkpoint, else None."""
        if self.guards is None:
            return None
        return self.guards.step_boundary(step, self.ckpt, data,
                                         lambda: self.beat("checkpoint_load", step))  # a rollback load is no hang

    # -- after every step ----------------------------------------------------------------
    def step_flags(self) -> List[bool]:
        """This rank's flags that every rank must act on at one step: signalled, a save failed, the memory
        tier's group failed, and whether each automatic interval (durable, memory) still waits for its
        measurements. Read just before the step's reduction, which carries them (training/grad_stats.py);
        always the same length, so the reduced vector's does not depend on the config."""
        waiting = {auto.tier: auto.waiting for auto in self.autos}
        memory = self.ckpt.memory
        return [self.preemption.requested_at is not None, self.ckpt.save_failure is not None,
                memory is not None and memory.group_failed, waiting.get("durable", False), waiting.get("memory", False)]

    def evaluated_for_save(self, seconds: float) -> None:
        """The evaluation before a durable save (eval.* runs one before every save) took ``seconds`` of the
        training thread: checkpoint.interval=auto counts the first in the save's cost."""
        for auto in self.autos:
            if auto.tier == "durable" and not auto.eval_before_save_s:
                auto.eval_before_save_s = seconds

    def end_of_step(self, step: int, step_s: float, result) -> bool:
        """After 1-based ``step`` (``result``: its StepResult, whose ``flags`` are ``step_flags()`` as
        the step's reduction agreed them): save when due, then the bookkeeping; True: stop now
        (preempted, the save committed). A save the storage refused, with checkpoint.on_save_error=stop,
        raises CheckpointSaveError here, on every rank at the same step."""
        ckpt, loss = self.ckpt, result.loss
        if ckpt.due(step):
            self.beat("checkpoint_snapshot", step)
        gate = self.guards.take_verified_block if self.guards is not None else None
        records = ckpt.after_step(step, loss, verified_gate=gate, probe_from_next_step=step < self.steps)
        for auto in self.autos:
            auto.record(step_s, records if auto.tier == "durable" else ckpt.memory.take_records(),
                        first=not self._first_step_done)
        self._first_step_done = True
        self.beat("step", step)
        self._watch_write()
        self.stragglers.record(step, result.local_seconds)
        # The flags as the step's reduction carried them; at a save step (the same on every rank) agreed
        # again on the control group, after the save: its outcome is known only now.
        pre = self.preemption
        preempted, save_failed, memory_off, *waiting = (pre.agree(*self.step_flags()[1:]) if ckpt.due(step)
                                                        else pre.agreed(result.flags))
        if save_failed:
            ckpt.raise_save_failure()
        if memory_off:
            ckpt.memory.turn_off(step)
        waiting = dict(zip(("durable", "memory"), waiting))
        for auto in self.autos:
            if auto.chosen is None and not waiting[auto.tier]:  # every rank has its measurements: choose together
                auto.choose(ckpt, step)
        if not preempted:
            return False
        self._save_before_exit(step, loss)
        return True

    def _watch_write(self) -> None:
        """Give each background write its own timer. A new save collects the previous one first,
        so back-to-back saves can stay "in flight" across steps: key the timer by the saved step."""
        writing = self.ckpt.writing
        step = writing[0] if writing is not None else None
        if step == self._writing:
            return
        self._writing = step
        if self.watchdog is not None:
            if writing is None:
                self.watchdog.write_done()
            else:
                self.watchdog.write_started(step, writing[1])

    def _save_before_exit(self, step: int, loss: float) -> None:
        pre, ckpt = self.preemption, self.ckpt
        left = pre.seconds_left()
        log.warning("preemption (%s): saving step %d, %.0f s of the %.0f s grace period left", pre.signal_name,
                    step, left, pre.grace_s)
        if self.watchdog is not None:  # a save that cannot commit within the grace period is abandoned
            self.watchdog.set_timeout("shutdown", max(1.0, left))
            self.beat("shutdown", step)
        t0 = time.perf_counter()
        ckpt.collect()  # a previous save that failed is an alarm (with on_save_error=stop the run ends here)
        if ckpt.save_failure is not None:
            ckpt.raise_save_failure()
        if ckpt.last_saved_step != step and ckpt.writes():  # replica groups: only the step's writer saves (the
            ckpt.save(step, loss)  # others hold the same state; two saves of one step would race for its folder)
        ckpt.wait()  # committed (coordinator) before anyone exits
        self._writing = None
        if self.watchdog is not None:
            self.watchdog.write_done()
        log.warning("preemption: step %d committed in %.2f s; exiting cleanly", step, time.perf_counter() - t0)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.preemption.uninstall()


class Preemption:
    """On SIGTERM/SIGUSR1 every rank saves at the same step boundary, then exits (RecoveryRuntime's
    _save_before_exit). The handler only sets a flag: saving from inside a signal handler would
    interleave with a half-done step. Ranks may get the signal at different moments, so they agree on
    the flag every step: the step's reduction carries it with the other flags every rank must act on
    at one step (RecoveryRuntime.step_flags), read just before it, so a signal that comes later
    stops the run one step later; ``agreed`` takes the result (``agree``: a collective of its own, at
    a save step). The grace period bounds the whole save; a save that cannot commit in time is
    abandoned (the previous committed checkpoint stays valid, contract 3). Under torchrun the signal
    goes to the agent: scripts/torchrun_preemptible.py forwards it to the workers
    (docs/recovery-runbook.md says which signal reaches which process)."""

    def __init__(self, signals: Iterable[str] = ("SIGTERM", "SIGUSR1"), grace_s: float = 120.0):
        self.signals = [getattr(signal, s) for s in signals]
        self.grace_s = grace_s
        self.requested_at: Optional[float] = None  # monotonic time of the first signal on this rank
        self.signal_name: Optional[str] = None
        self._previous = {}

    def install(self) -> "Preemption":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal_name = signal.Signals(signum).name

    def agree(self, *flags: bool) -> Tuple[bool, ...]:
        """Collective, one all_reduce MAX on the control group: (any rank signalled, then each of
        ``flags`` true on any rank). For a caller without the step's reduction to carry them."""
        values = [1 if self.requested_at is not None else 0] + [1 if f else 0 for f in flags]
        return self.agreed(bool(v) for v in collectives.agree_max(values, dtype=torch.int32))

    def agreed(self, flags: Iterable[bool]) -> Tuple[bool, ...]:
        """``flags`` as every rank agreed them, the first one "any rank signalled"; returned as they are."""
        flags = tuple(flags)
        if flags[0] and self.requested_at is None:
            self.requested_at = time.monotonic()  # another rank was signalled; start our clock too
            self.signal_name = "peer"
        return flags

    def seconds_left(self) -> float:
        """Of the grace period, from the first signal seen on this rank."""
        if self.requested_at is None:
            return self.grace_s
        return self.grace_s - (time.monotonic() - self.requested_at)


def torchrun_grace_problem(grace_s: float, environ=os.environ) -> Optional[str]:
    """Under torchrun: the agent SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by
    default) after it got SIGTERM; a shorter time than the grace period cuts preemption saves off.
    The workers inherit the agent's environment, so they can see it (not ``--shutdown-timeout``)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    shutdown = float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    if shutdown >= grace_s:
        return None
    return (f"torchrun kills its workers {shutdown:.0f} s after it gets SIGTERM (TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
            f"{'' if 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT' in environ else ' unset: the default'}), less than "
            f"recovery.preemption_grace_s={grace_s:g}: a preemption save may be cut off. Launch with "
            f"scripts/launch_single_node.sh or scripts/launch_multi_node.sh, or export "
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={int(grace_s) + 30} (docs/recovery-runbook.md)")


STRAGGLER_MIN_EXCESS_S = 0.01  # a few milliseconds over the median is the host's noise, not a slow rank


def find_stragglers(step_seconds: Sequence[float], factor: float) -> List[int]:
    """Ranks whose time exceeds ``factor`` x the median over ranks (and the median by 10 ms)."""
    if not step_seconds:
        return []
    median = statistics.median(step_seconds)
    return [r for r, t in enumerate(step_seconds)
            if median > 0 and t > factor * median and t - median > STRAGGLER_MIN_EXCESS_S]


class StragglerMonitor:
    """The rank that makes every collective wait, named in the log. A slow rank (thermal throttling, a bad
    NIC, a noisy neighbour) does not fail: it slows every step. Each rank records the time of its own work
    in each step (StepResult.local_seconds: the loop's wall time cannot show it, the step's collectives
    make it equal on every rank); every ``interval`` steps the means are gathered and a rank above
    ``factor`` x the median is named."""

    def __init__(self, interval: int, factor: float):
        self.interval, self.factor = interval, factor
        self._times: List[float] = []
        self.last_report: Optional[List[float]] = None

    def record(self, step: int, seconds: float) -> List[int]:
        """Add one step's rank-local time; on a reporting step return the stragglers (all ranks call this)."""
        self._times.append(seconds)
        if self.interval <= 0 or step % self.interval:
            return []
        mine = sum(self._times) / len(self._times)
        self._times = []
        per_rank = collectives.gather_floats(mine)
        self.last_report = per_rank
        slow = find_stragglers(per_rank, self.factor)
        median = statistics.median(per_rank)
        for r in slow:
            log.warning("straggler: rank %d took %.3f s per step of its own work (before waiting for its peers) "
                        "over the last %d steps, %.1fx the median %.3f s (threshold %.1fx)", r, per_rank[r],
                        self.interval, per_rank[r] / median, median, self.factor)
        return slow


class AutoInterval:
    """checkpoint.interval=auto (or checkpoint.memory.interval=auto, ``tier="memory"``): measure, then set
    the Young/Daly interval (recovery/interval.py) once, logged. The manager takes a first save after
    AUTO_MEASURE_STEPS steps: its SaveRecord's blocking time (plus the evaluation it forced) and background
    time (an async write; a snapshot's write, replica and commit), with the median step time (the first step
    excluded) and the job's MTBF, choose the interval.

    The interval decides at which steps every rank enters a save's collectives, so it is chosen once for
    all: when no rank is still ``waiting`` for its first record (agreed with the step's other flags), from
    the maximum over ranks of each measurement (the coordinator's write includes the commit; a throttled
    GPU's steps are slower).
    """

    def __init__(self, rc: RecoveryConfig, steps: int, world_size: int, tier: str = "durable"):
        self.steps, self.tier = steps, tier
        self.mtbf_s = cluster_mtbf_s(rc.device_mtbf_hours, rc.devices or world_size)
        self.step_times: list = []
        self.first_save: Optional[SaveRecord] = None
        self.eval_before_save_s = 0.0  # the evaluation a durable save forces: the training thread pays it too
        self.chosen = None

    def record(self, step_s: float, saves: List[SaveRecord], first: bool) -> None:
        if not first:
            self.step_times.append(step_s)
        if saves and self.first_save is None:
            self.first_save = saves[0]

    @property
    def waiting(self) -> bool:
        """Not chosen yet, and this rank still lacks its first save's record or a step time."""
        return self.chosen is None and (self.first_save is None or not self.step_times)

    def choose(self, ckpt, step: int) -> None:
        """Every rank calls it at the same step (one all_reduce MAX), and all set the same interval."""
        save = self.first_save
        step_s, blocking_s, write_s = collectives.agree_max(
            [statistics.median(self.step_times), save.blocking_s + self.eval_before_save_s, save.background_s])
        self.chosen = choose_interval_steps(step_s, blocking_s, write_s, self.mtbf_s,
                                            max_steps=self.steps)
        (ckpt.memory.set_interval if self.tier == "memory" else ckpt.set_interval)(self.chosen.steps)
        key = "checkpoint.memory.interval" if self.tier == "memory" else "checkpoint.interval"
        log.info("%s=auto: every %d steps (%s)", key, self.chosen.steps, self.chosen.reason)
        ckpt.log_event(step, kind="checkpoint_interval", tier=self.tier, interval_steps=self.chosen.steps,
                       step_s=step_s, blocking_s=blocking_s, write_s=write_s, mtbf_s=self.mtbf_s,
                       optimum_s=self.chosen.optimum_s)


def log_elastic(state, plan, world_size: int) -> None:
    """Say how a resume at another world size keeps the global batch (contract 5)."""
    meta = state.meta or {}
    saved_world = meta.get("world_size", world_size)
    saved_layout = meta.get("layout", {})
    saved_dp = data_parallel_size(saved_layout) if saved_layout else None
    if saved_world == world_size:
        return
    old_accum = (plan.global_batch_size // (saved_dp * plan.micro_batch_size)
                 if saved_dp and plan.global_batch_size % (saved_dp * plan.micro_batch_size) == 0 else "?")
    log.warning("elastic resume: checkpoint saved at world %d (dp %s, grad_accum_steps %s), now world %d "
                "(dp %d): grad_accum_steps recomputed to %d so the global batch stays %d sequences "
                "(%d x micro %d x accum %d)", saved_world, saved_dp, old_accum, world_size, plan.dp_size,
                plan.grad_accum_steps, plan.global_batch_size, plan.dp_size, plan.micro_batch_size,
                plan.grad_accum_steps)
