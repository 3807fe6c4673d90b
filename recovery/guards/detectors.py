"""Anomaly detectors on scalar streams: pure Python, no torch, unit-testable.

Each detector compares a new value with a statistic of the *healthy* past: values that
raised an alarm are not folded into the statistic, so one spike cannot teach the detector
that spikes are normal. Every detector stays silent for its first ``warmup`` values
(the start of training is legitimately wild).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional


@dataclass(frozen=True)
class Anomaly:
    source: str  # "grad_norm/<layer>", "loss", "shadow_loss", ...
    value: float
    threshold: float
    reason: str

    def describe(self) -> str:
        return f"{self.source}={self.value:.6g} ({self.reason}; threshold {self.threshold:.6g})"


class RatioToRunningMean:
    """Per-key ratio test: alarm when value > multiple x the EMA of its healthy history.

    Used for per-layer gradient norms: a bit flip in a weight or gradient shows up as one
    layer's norm jumping by orders of magnitude, while healthy norms drift slowly.
    """

    def __init__(self, multiple: float, warmup: int, beta: float = 0.95, prefix: str = "grad_norm"):
        if multiple <= 1:
            raise ValueError(f"grad_norm_multiple={multiple} must be > 1")
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

    The median and the median absolute deviation ignore the outliers they are meant to
    catch; the relative floor keeps a very flat stretch (tiny MAD) from alarming on noise.
    Only upward jumps count: a loss that falls faster than usual is good news.
    """

    def __init__(self, source: str, k: float, rel: float, window: int, warmup: int):
        if window < 3:
            raise ValueError(f"{source}: window={window} must be >= 3")
        self.source, self.k, self.rel, self.warmup = source, k, rel, warmup
        self.history: Deque[float] = deque(maxlen=window)
        self.seen = 0

    def threshold(self) -> Optional[float]:
        if self.seen < self.warmup or len(self.history) < 3:
            return None
        med = statistics.median(self.history)
        mad = statistics.median(abs(x - med) for x in self.history)
        return med + max(self.k * 1.4826 * mad, self.rel * abs(med))

    def update(self, value: float) -> Optional[Anomaly]:
        if not math.isfinite(value):
            return Anomaly(self.source, value, math.inf, "not finite")
        limit = self.threshold()
        if limit is not None and value > limit:
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
