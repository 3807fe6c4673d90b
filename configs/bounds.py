"""What every number in the config can be: finite, and within the bounds declared here, key by key.

The per-package checks (``<package>/checks.py``) say why a value is wrong in their own words; this
table is the floor under them, so that NaN, an infinity, a zero divisor or a seed numpy refuses never
reaches the model. ``tests/integration/test_bad_inputs.py`` enumerates the schema's numeric keys and fails on one
missing here, so a new key must declare what it can be. Torch-free, no project imports.

Keys: dotted; ``[]`` stands for any list index (``recovery.faults[].step``), ``*`` for any key of a
mapping (``recovery.timeouts.*``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

MAX_SECONDS = 1e8  # about three years: longer waits overflow timedelta and Event.wait, and mean "never"
# The attempt lease's heartbeat beats every lease_timeout_s / 4 (checkpoint/durable/lease.py). A beat is a write to
# the checkpoint storage, which can stall for seconds on a shared file system or an object store, and another
# host reads its age against its own clock: below this a live owner looks dead (and the heartbeat spins).
MIN_LEASE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Bound:
    """low <= value (low < value when ``open_low``), value <= high (< when ``open_high``); ``also``:
    sentinel values allowed besides (-1: "any" / "fill")."""

    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False
    open_high: bool = False
    also: Tuple[int, ...] = ()
    why: str = ""

    def holds(self, value) -> bool:
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):  # an int never is (and may not fit a float)
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.open_high else '<='} {_num(self.high)}"
        else:
            text = "a finite number"
        return text + "".join(f" or {a}" for a in self.also) + (f" ({self.why})" if self.why else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


POSITIVE = Bound(0, open_low=True)
NON_NEGATIVE = Bound(0)
AT_LEAST_1 = Bound(1)
FRACTION = Bound(0, 1, open_high=True)  # [0, 1)
SECONDS = Bound(0, MAX_SECONDS, open_low=True)
SIZE = Bound(1, 2**31 - 1)  # a tensor dimension: positive and an int32 index

BOUNDS: Dict[str, Bound] = {
    "seed": Bound(0, 2**32 - 1, why="the range numpy's and torch's generators both accept"),
    "model.dim": SIZE, "model.n_layers": Bound(1, 2**20), "model.n_heads": SIZE, "model.n_kv_heads": SIZE,
    "model.vocab_size": SIZE, "model.intermediate_size": SIZE,
    "model.multiple_of": Bound(1, 2**31 - 1, why="the FFN width is rounded up to it"),
    "model.ffn_dim_multiplier": Bound(0, 100, open_low=True),
    "model.norm_eps": Bound(0, 1, open_low=True), "model.rope_theta": Bound(0, 1e30, open_low=True),
    "model.max_seq_len": Bound(1, 2**24), "model.dropout": FRACTION, "model.init_std": Bound(0, 1, open_low=True),
    # model.rope_scaling's numbers (llama3 scaling, model/rope.py): a finite context extension of a finite context
    "model.rope_scaling.factor": Bound(1, 1e6), "model.rope_scaling.low_freq_factor": Bound(0, 1e6, open_low=True),
    "model.rope_scaling.high_freq_factor": Bound(0, 1e6, open_low=True),
    "model.rope_scaling.original_max_position_embeddings": Bound(1, 2**24),
    "parallel.dp_replicate": AT_LEAST_1, "parallel.dp_shard": Bound(1, also=(-1,)), "parallel.tp": AT_LEAST_1,
    "parallel.collective_timeout_s": SECONDS, "parallel.collective_timeout_after_first_step_s": SECONDS,
    "data.bpe_vocab_size": Bound(257, 2**31 - 1), "data.mixture[].weight": POSITIVE,
    "data.num_workers": Bound(0, 1024), "data.prefetch_factor": Bound(1, 1024), "data.validation_fraction": FRACTION,
    "training.steps": AT_LEAST_1, "training.global_batch_size": SIZE, "training.micro_batch_size": SIZE,
    "training.seq_len": AT_LEAST_1, "training.grad_clip": NON_NEGATIVE, "training.ema_decay": FRACTION,
    "eval.interval": NON_NEGATIVE, "eval.batches": AT_LEAST_1,
    "optim.lr": Bound(0, 10, open_low=True), "optim.lr_min": NON_NEGATIVE, "optim.warmup_steps": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE, "optim.beta1": FRACTION, "optim.beta2": FRACTION, "optim.eps": POSITIVE,
    "checkpoint.keep_last": AT_LEAST_1, "checkpoint.keep_every": NON_NEGATIVE, "checkpoint.keep_forensic": NON_NEGATIVE,
    "checkpoint.keep_best": NON_NEGATIVE, "checkpoint.load_threads": Bound(1, 256),
    "checkpoint.commit_timeout_s": SECONDS,
    "checkpoint.lease_timeout_s": Bound(MIN_LEASE_TIMEOUT_S, MAX_SECONDS, why=(
        f"the heartbeat beats every lease_timeout_s / 4; a beat must outlast a slow write to shared storage and "
        f"clock skew between hosts: use >= {MIN_LEASE_TIMEOUT_S:g} s, e.g. the default 60")),
    "checkpoint.memory.replicas": Bound(0, 1), "checkpoint.memory.node": NON_NEGATIVE,
    "recovery.timeouts.*": SECONDS, "recovery.checkpoint_write_timeout_s": SECONDS,
    "recovery.straggler_interval": NON_NEGATIVE, "recovery.straggler_factor": Bound(1, open_low=True),
    "recovery.preemption_grace_s": SECONDS, "recovery.probe_rtol_reshard": POSITIVE,
    "recovery.max_fallbacks": NON_NEGATIVE, "recovery.read_retries": NON_NEGATIVE,
    "recovery.read_retry_backoff_s": SECONDS, "recovery.device_mtbf_hours": POSITIVE, "recovery.devices": NON_NEGATIVE,
    "recovery.faults[].step": Bound(1, also=(-1,)), "recovery.faults[].rank": Bound(0, also=(-1,)),
    "recovery.faults[].hang_s": SECONDS, "recovery.faults[].bit": Bound(0, 32, open_high=True),
    "recovery.faults[].delay_s": Bound(0, MAX_SECONDS), "recovery.faults[].times": Bound(1, also=(-1,)),
    "recovery.faults[].skip": NON_NEGATIVE,
    "recovery.guards.warmup_steps": NON_NEGATIVE, "recovery.guards.grad_norm_multiple": Bound(1, open_low=True),
    "recovery.guards.loss_spike_k": POSITIVE, "recovery.guards.loss_spike_rel": POSITIVE,
    "recovery.guards.loss_window": Bound(3), "recovery.guards.shadow_interval": NON_NEGATIVE,
    "recovery.guards.shadow_rel": POSITIVE, "recovery.guards.shadow_window": Bound(3),
    "recovery.guards.replica_interval": NON_NEGATIVE, "recovery.guards.max_consecutive_skips": AT_LEAST_1,
    "recovery.guards.max_rollbacks": AT_LEAST_1, "recovery.guards.rollback_min_age_steps": NON_NEGATIVE,
    "logging.log_interval": AT_LEAST_1, "logging.peak_tflops": POSITIVE,
}


def pattern_of(key: str) -> str:
    """``recovery.faults[2].step`` -> ``recovery.faults[].step``; a mapping's key -> ``*``."""
    key = re.sub(r"\[\d+\]", "[]", key)
    return key if key in BOUNDS else key.rsplit(".", 1)[0] + ".*"


def bound_problems(values: List[Tuple[str, object]]) -> List[str]:
    """One message per (key, value) outside its declared bound (keys without one are not checked here)."""
    out = []
    for key, value in values:
        bound = BOUNDS.get(pattern_of(key))
        if bound is None or value is None or isinstance(value, bool):
            continue
        if not bound.holds(value):
            what = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            out.append(f"{key}={value} must be {what}{bound.describe()}")
    return out


DIVISOR_SEARCH_LIMIT = 2**36  # trial division up to its square root: 2**18 steps, a few hundredths of a second


def divisors(n: int) -> Optional[List[int]]:
    """The divisors of ``n`` ascending (for the checks' suggestions), by trial division up to its square root;
    None when ``n`` is above DIVISOR_SEARCH_LIMIT or not a positive integer: a suggestion never costs a hang."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= DIVISOR_SEARCH_LIMIT:
        return None
    low, high = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            low.append(d)
            if d != n // d:
                high.append(n // d)
    return low + high[::-1]
