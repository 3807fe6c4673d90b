"""The training loop's guards against silent corruption and loss spikes.

Checked every step between backward and the optimizer update (so the update can still be
skipped): each layer's gradient norm against its running mean, non-finite loss or
gradients, and the loss against a robust running statistic. Every ``shadow_interval``
steps: the loss of a fixed batch against its own history. Every ``replica_interval``
steps with dp_replicate > 1: a fingerprint of the weights across replicas.

Actions (``recovery.guards.action``) for gradient and loss alarms:
  log             record the alarm, train on
  skip_step       drop this step's update (the data window is consumed)
  block_verified  train on, but the next checkpoint is not marked verified
  rollback        drop the update, then restore the newest verified checkpoint and skip
                  the data window since it
Every alarm except under ``log`` blocks the next checkpoint from being marked verified.
Shadow and replica alarms cannot be undone by skipping an update (the weights are already
wrong), so under skip_step they escalate to rollback, as do ``max_consecutive_skips``
skipped steps in a row.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel import collectives
from parallel.dims import REPLICATE
from recovery.guards.alarms import Alarm, AlarmSink
from recovery.guards.config import ACTIONS, GuardsConfig
from recovery.guards.detectors import Anomaly, RatioToRunningMean, RobustSpike
from recovery.guards.replica import check_replicas
from recovery.guards.rollback import RollbackRequested, roll_back
from training.grad_stats import layer_grad_norms, layer_groups

log = logging.getLogger("trainer")


class TrainingGuards:
    def __init__(self, cfg, model: nn.Module, device: torch.device, run_dir: Path | str, rank: int,
                 metrics=None, shadow_loss: Optional[Callable[[], float]] = None,
                 replicate_group: Optional[dist.ProcessGroup] = None):
        if cfg.action not in ACTIONS:
            raise ValueError(f"recovery.guards.action={cfg.action!r}: choose one of {list(ACTIONS)}")
        self.cfg = cfg
        self.model, self.device = model, device
        self.groups = layer_groups(model)
        self.grad_norms = RatioToRunningMean(cfg.grad_norm_multiple, cfg.warmup_steps)
        self.loss = RobustSpike("loss", cfg.loss_spike_k, cfg.loss_spike_rel, cfg.loss_window, cfg.warmup_steps)
        self.shadow = RobustSpike("shadow_loss", cfg.loss_spike_k, cfg.shadow_rel, cfg.shadow_window, 2)
        self.shadow_loss, self.replicate_group = shadow_loss, replicate_group
        self.sink = AlarmSink(run_dir, rank, metrics)
        self.consecutive_skips = 0
        self.rollbacks = 0  # done by this process (recovery.guards.max_rollbacks bounds them)
        self.block_reason: Optional[str] = None
        self.last_layer_norms: dict = {}
        self._rollback_after_skip: Optional[RollbackRequested] = None

    # -- every step, between backward and the optimizer update ---------------------------
    def allow_update(self, step: int, loss: float, layer_norms: Optional[Dict[str, float]] = None) -> bool:
        """False: skip this update. Raises RollbackRequested after skipping when asked to. The trainer
        passes the loss and ``layer_norms`` of its step's one all-reduce (training/grad_stats.py), the
        same bits on every rank; without them (one process) the norms are computed here."""
        if not self.cfg.enabled:
            return True
        if layer_norms is None:
            layer_norms = layer_grad_norms(self.groups, self.device)
        self.last_layer_norms = layer_norms
        found: List[Anomaly] = self.grad_norms.update(self.last_layer_norms)
        check = "grad_norm" if found else "loss_spike"
        spike = self.loss.update(loss)
        if spike is not None:
            found.append(spike)
        if not found:
            self.consecutive_skips = 0
            return True
        action = self.cfg.action
        if action == "skip_step" and self.consecutive_skips + 1 >= self.cfg.max_consecutive_skips:
            action = "rollback"
        self._alarm(step, check, action, found)
        if action in ("log", "block_verified"):
            return True
        self.consecutive_skips += 1
        if action == "rollback":
            self._rollback_after_skip = RollbackRequested(step, found[0].describe())
        return False

    def step_boundary(self, step: int, ckpt, data, run_dir: Path, before_load: Callable[[], None]) -> Optional[int]:
        """After the update of ``step``: the periodic checks, and a rollback they (or the step's own check) asked
        for, done here (``before_load`` first). The step to go on from after a rollback, else None."""
        try:
            self.after_update(step)
        except RollbackRequested as request:
            before_load()
            self.rollbacks += 1
            return roll_back(request, self, ckpt, data, self.cfg, run_dir, self.rollbacks - 1)
        return None

    def after_update(self, step: int) -> None:
        """At the step boundary: raise a pending rollback, run the periodic checks."""
        pending = self._rollback_after_skip
        if pending is not None:
            self._rollback_after_skip = None
            raise pending
        if not self.cfg.enabled:
            return
        found = {}  # check -> this rank's anomaly
        every = self.cfg.shadow_interval
        if self.shadow_loss is not None and every > 0 and step % every == 0:
            found["shadow"] = self.shadow.update(self.shadow_loss())
        every = self.cfg.replica_interval
        if self.replicate_group is not None and every > 0 and step % every == 0:
            found["replica"] = self._replica_anomaly()
        if not found:
            return
        # Each rank saw its own probe loss and its own replica group: one rank's alarm is everyone's,
        # or that rank alone would roll back (broadcasts, loads) while the others train on.
        alarmed = collectives.agree_max([1 if found[c] is not None else 0 for c in found], dtype=torch.int32)
        if not any(alarmed):
            return
        # Agreed: every rank takes this path. Which ranks alarmed, and what they saw, for the record.
        everyone = collectives.all_gather_object(found)
        for check, seen in zip(list(found), alarmed):
            if seen:
                ranks = [r for r, theirs in enumerate(everyone) if theirs.get(check) is not None]
                anomaly = found[check] or everyone[ranks[0]][check]
                self._escalate(step, check, [anomaly], ranks=ranks)

    def _replica_anomaly(self) -> Optional[Anomaly]:
        bad = check_replicas(self.model, self.device, self.replicate_group)
        if not bad:
            return None
        size = dist.get_world_size(self.replicate_group)
        who = f"replica(s) {bad} (dp_replicate index) differ from the majority" if len(bad) < size else \
            f"all {size} replicas {bad} disagree (no majority{' with 2 replicas' if size == 2 else ''})"
        return Anomaly("replica_fingerprint", float(len(bad)), 0.0, f"weights differ across replicas: {who}")

    def after_rollback(self) -> None:
        """The state is a verified checkpoint again: earlier alarms no longer taint the next save."""
        self.block_reason = None
        self.consecutive_skips = 0
        self._rollback_after_skip = None

    # -- checkpoint side --------------------------------------------------------------------
    def take_verified_block(self) -> Optional[str]:
        """Why the checkpoint being saved now must not be marked verified (None: it may be)."""
        reason, self.block_reason = self.block_reason, None
        return reason

    def _escalate(self, step: int, check: str, anomalies: List[Anomaly], ranks: Optional[List[int]] = None) -> None:
        action = "rollback" if self.cfg.action in ("skip_step", "rollback") else self.cfg.action
        self._alarm(step, check, action, anomalies, ranks)
        if action == "rollback":
            raise RollbackRequested(step, anomalies[0].describe())

    def _alarm(self, step: int, check: str, action: str, anomalies: List[Anomaly],
               ranks: Optional[List[int]] = None) -> None:
        self.sink.raise_alarm(Alarm(step, check, action, anomalies, ranks))
        if action != "log" and self.block_reason is None:  # keep the first alarm since the last save
            self.block_reason = f"step {step} {check} alarm: {anomalies[0].describe()}"

    def state_dict(self) -> dict:
        """Everything that decides a later alarm: the detectors' histories, the skip streak, the
        reason the next save is not verified, a rollback asked for but not yet done."""
        pending = self._rollback_after_skip
        return {"grad_norms": self.grad_norms.state_dict(), "loss": self.loss.state_dict(),
                "shadow": self.shadow.state_dict(), "consecutive_skips": self.consecutive_skips,
                "block_reason": self.block_reason,
                "pending_rollback": (pending.step, pending.reason) if pending is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.grad_norms.load_state_dict(state["grad_norms"])
        self.loss.load_state_dict(state["loss"])
        self.shadow.load_state_dict(state["shadow"])
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.block_reason = state.get("block_reason")
        pending = state.get("pending_rollback")
        self._rollback_after_skip = RollbackRequested(*pending) if pending else None


def build_guards(g: GuardsConfig, run_dir: Path, model: nn.Module, world, parallel,
                 probe: Optional[Callable[[], float]], metrics) -> TrainingGuards:
    """The guards for this run (``g``: recovery.guards): the shadow check reuses the checkpoint's probe batch,
    the replica check the process group across replicas."""
    replicate_group = None
    if parallel.mesh is not None and REPLICATE in parallel.mesh.mesh_dim_names and parallel.mesh[REPLICATE].size() > 1:
        replicate_group = parallel.mesh[REPLICATE].get_group()
    guards = TrainingGuards(g, model, world.device, run_dir, world.rank, metrics, shadow_loss=probe,
                            replicate_group=replicate_group)
    if g.enabled:
        log.info("guards: action %s, grad-norm x%g and loss spikes every step, shadow every %d steps, %s",
                 g.action, g.grad_norm_multiple, g.shadow_interval,
                 f"replica fingerprints over {dist.get_world_size(replicate_group)} replicas every "
                 f"{g.replica_interval} steps" if replicate_group is not None else "no replica check (dp_replicate=1)")
    return guards
