"""The training loop's guards against silent corruption and loss spikes (docs/guards.md: the checks,
their thresholds, the actions).

Every step, between backward and the update (so the update can still be skipped): each layer's
gradient norm against its running mean, and the loss against a robust running statistic. Every
``shadow_interval`` steps: the probe batch's loss against its own history; every ``replica_interval``
steps with dp_replicate > 1: a fingerprint of the weights across replicas. A gradient or loss alarm does
what ``recovery.guards.action`` says (log, skip_step, block_verified, rollback); shadow and replica
alarms mean the weights are already wrong, so skip_step escalates them to rollback, as it does
``max_consecutive_skips`` skipped steps in a row. Every alarm but under ``log`` keeps the next
checkpoint from being marked verified.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from parallel import collectives
from parallel.dims import REPLICATE
from recovery.guards.config import ACTIONS, GuardsConfig
from recovery.guards.rollback import RollbackRequested, roll_back
from training.grad_stats import layer_grad_norms, layer_groups

log = logging.getLogger("trainer")


# -- the detectors: a new value against a statistic of the healthy past ----------------------
# Values that raised an alarm are not folded into the statistic, so one spike cannot teach a
# detector that spikes are normal; each stays silent for its first ``warmup`` values.

@dataclass(frozen=True)
class Anomaly:
    source: str  # "grad_norm/<layer>", "loss", "shadow_loss", ...
    value: float
    threshold: float
    reason: str

    def describe(self) -> str:
        return f"{self.source}={self.value:.6g} ({self.reason}; threshold {self.threshold:.6g})"


class RatioToRunningMean:
    """Per-key: alarm when value > multiple x the EMA of its healthy history. A bit flip in a weight or
    gradient shows up as one layer's gradient norm jumping by orders of magnitude; healthy norms drift."""

    def __init__(self, multiple: float, warmup: int, beta: float = 0.95, prefix: str = "grad_norm"):
        self.multiple, self.warmup, self.beta, self.prefix = multiple, warmup, beta, prefix
        self.mean: Dict[str, float] = {}
        self.count: Dict[str, int] = {}

    def update(self, values: Dict[str, float]) -> List[Anomaly]:
        found = []
        for key, value in values.items():
            source = f"{self.prefix}/{key}"
            if not math.isfinite(value):
                found.append(Anomaly(source, value, math.inf, "not finite"))
                continue
            n = self.count.get(key, 0)
            mean = self.mean.get(key)
            if mean is not None and n >= self.warmup and value > self.multiple * mean:
                found.append(Anomaly(source, value, self.multiple * mean,
                                     f"{value / mean:.1f}x its running mean {mean:.4g}"))
                continue
            self.mean[key] = value if mean is None else self.beta * mean + (1 - self.beta) * value
            self.count[key] = n + 1
        return found

    def state_dict(self) -> dict:
        return {"mean": dict(self.mean), "count": dict(self.count)}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.count = dict(state["mean"]), dict(state["count"])


class RobustSpike:
    """Alarm when a value rises above median + max(k x 1.4826 x MAD, rel x median) of a window.

    The median and the MAD ignore the outliers they are meant to catch; the relative floor keeps a
    very flat stretch (tiny MAD) from alarming on noise. Only upward jumps count."""

    def __init__(self, source: str, k: float, rel: float, window: int, warmup: int):
        self.source, self.k, self.rel, self.warmup = source, k, rel, warmup
        self.history: Deque[float] = deque(maxlen=window)
        self.seen = 0

    def update(self, value: float) -> Optional[Anomaly]:
        if not math.isfinite(value):
            return Anomaly(self.source, value, math.inf, "not finite")
        if self.seen >= self.warmup and len(self.history) >= 3:
            med = statistics.median(self.history)
            mad = statistics.median(abs(x - med) for x in self.history)
            limit = med + max(self.k * 1.4826 * mad, self.rel * abs(med))
            if value > limit:
                return Anomaly(self.source, value, limit, "spike above the robust running statistic")
        self.history.append(value)
        self.seen += 1
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state["history"])
        self.seen = state["seen"]


# -- cross-replica consistency (dp_replicate > 1: every replica must hold identical weights) ---

def param_fingerprint(model: nn.Module, device: torch.device) -> torch.Tensor:
    """The int64 sum of each parameter's raw words on this rank: any single bit flip changes it. Of the
    sharded fp32 masters: after a no-grad forward (an evaluation, the probe) FSDP2 keeps the gathered
    copies of a module that does not reshard after forward registered, and a bf16 copy rounds low bits away."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # no-op where sharded already; the next forward gathers again
    total = torch.zeros((), dtype=torch.int64, device=device)
    for p in model.parameters():
        data = (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous()
        words = data.view({4: torch.int32, 2: torch.int16}.get(data.element_size(), torch.int64))
        total += words.sum(dtype=torch.int64)
    return total


def disagreeing_replicas(fingerprints: List[int]) -> List[int]:
    """Indices of replicas whose fingerprint differs from the majority (all, if no majority: with two
    replicas both are named)."""
    counts = Counter(fingerprints)
    if len(counts) == 1:
        return []
    value, votes = counts.most_common(1)[0]
    if votes * 2 > len(fingerprints):
        return [i for i, f in enumerate(fingerprints) if f != value]
    return list(range(len(fingerprints)))


# -- the guards -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alarm:
    step: int
    check: str  # grad_norm | loss_spike | shadow | replica
    action: str  # what the trainer does about it
    anomalies: List[Anomaly]
    # The ranks whose own check alarmed (shadow, replica: each rank checks what it holds); None for
    # the checks every rank computes from the same all-reduced values (gradient norms, loss).
    ranks: Optional[List[int]] = None

    def describe(self) -> str:
        return "; ".join(a.describe() for a in self.anomalies)


class TrainingGuards:
    def __init__(self, cfg, model: nn.Module, device: torch.device, run_dir: Path | str, rank: int,
                 metrics=None, shadow_loss: Optional[Callable[[], float]] = None,
                 replicate_group: Optional[dist.ProcessGroup] = None):
        if cfg.action not in ACTIONS:
            raise ValueError(f"recovery.guards.action={cfg.action!r}: choose one of {list(ACTIONS)}")
        self.cfg = cfg
        self.model, self.device, self.rank, self.metrics = model, device, rank, metrics
        self.alarms_dir = Path(run_dir) / "alarms"
        self.groups = layer_groups(model)
        self.grad_norms = RatioToRunningMean(cfg.grad_norm_multiple, cfg.warmup_steps)
        self.loss = RobustSpike("loss", cfg.loss_spike_k, cfg.loss_spike_rel, cfg.loss_window, cfg.warmup_steps)
        self.shadow = RobustSpike("shadow_loss", cfg.loss_spike_k, cfg.shadow_rel, cfg.shadow_window, 2)
        self.shadow_loss, self.replicate_group = shadow_loss, replicate_group
        self.raised: List[Alarm] = []
        self.consecutive_skips = 0
        self.rollbacks = 0  # done by this process (recovery.guards.max_rollbacks bounds them)
        self.block_reason: Optional[str] = None
        self._rollback_after_skip: Optional[RollbackRequested] = None
        # parallel.fault_tolerance: the step boundary's verdict agreed across the replica groups, the action alike
        # (recovery/guards/across_groups.py); set by the trainer once the torchft manager exists
        self.across_groups = None

    # -- every step, between backward and the optimizer update ---------------------------
    def allow_update(self, step: int, loss: float, layer_norms: Optional[Dict[str, float]] = None) -> bool:
        """False: skip this update. Raises RollbackRequested after skipping when asked to. The trainer
        passes the loss and ``layer_norms`` of its step's one all-reduce (training/grad_stats.py), the
        same bits on every rank; without them (one process) the norms are computed here."""
        if not self.cfg.enabled:
            return True
        if layer_norms is None:
            layer_norms = layer_grad_norms(self.groups, self.device)
        found: List[Anomaly] = self.grad_norms.update(layer_norms)
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

    def step_boundary(self, step: int, ckpt, data, before_load: Callable[[], None]) -> Optional[int]:
        """After the update of ``step``: the periodic checks, and a rollback they (or the step's own check) asked
        for, done here (``before_load`` first). The step to go on from after a rollback, else None."""
        if self.across_groups is not None:  # the verdict agreed with the other replica groups, the action alike
            return self.across_groups.step_boundary(self, step, ckpt, data, before_load)
        try:
            self.after_update(step)
        except RollbackRequested as request:
            before_load()
            return roll_back(request, self, ckpt, data)
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
        """Ranks of one replica group hold the same shard: their fingerprints, gathered, must be equal."""
        size = dist.get_world_size(self.replicate_group)
        if size < 2:
            return None
        gathered = collectives.all_gather(param_fingerprint(self.model, self.device), self.replicate_group)
        bad = disagreeing_replicas([int(t) for t in gathered])
        if not bad:
            return None
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
        """Raise an alarm: the log, metrics.jsonl (kind "alarm") and, on rank 0, a JSON record in the run dir."""
        alarm = Alarm(step, check, action, anomalies, ranks)
        self.raised.append(alarm)
        where = "" if ranks is None else f" (alarmed on rank(s) {ranks})"
        log.warning("ALARM step %d [%s] -> %s%s: %s", step, check, action, where, alarm.describe())
        if self.metrics is not None:
            self.metrics.log_event(step, kind="alarm", check=check, action=action, detail=alarm.describe(),
                                   ranks=ranks)
        if self.rank == 0:
            self.alarms_dir.mkdir(parents=True, exist_ok=True)
            record = {"step": step, "check": check, "action": action, "rank": self.rank, "alarmed_on_ranks": ranks,
                      "host": socket.gethostname(), "time": time.time(), "anomalies": [asdict(a) for a in anomalies]}
            path = self.alarms_dir / f"step{step:08d}-{check}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
            os.replace(tmp, path)
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
