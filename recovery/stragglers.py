"""Straggler report: the rank that makes every collective wait, named in the log.

A slow rank (thermal throttling, a bad NIC, a noisy neighbour) does not fail: it slows
every step. Each rank records its own step times (the caller chooses the measure: the
wall time of the step, or better the rank-local part before its blocking collectives,
which is where a slow rank differs from the others); every ``interval`` steps the means
are gathered and a rank above ``factor`` x the median is named in the log.
"""

from __future__ import annotations

import logging
import statistics
from typing import List, Optional, Sequence

import torch.distributed as dist

from parallel import collectives

log = logging.getLogger("trainer")


def find_stragglers(step_seconds: Sequence[float], factor: float) -> List[int]:
    """Ranks whose time exceeds ``factor`` x the median over ranks."""
    if not step_seconds:
        return []
    median = statistics.median(step_seconds)
    return [r for r, t in enumerate(step_seconds) if median > 0 and t > factor * median]


class StragglerMonitor:
    """Accumulates this rank's step times; every ``interval`` steps gathers and reports."""

    def __init__(self, interval: int, factor: float, group: Optional[dist.ProcessGroup] = None):
        self.interval = interval
        self.factor = factor
        self.group = group
        self._times: List[float] = []
        self.last_report: Optional[List[float]] = None

    def record(self, step: int, seconds: float) -> List[int]:
        """Add one step's time; on a reporting step return the stragglers (all ranks call this)."""
        self._times.append(seconds)
        if self.interval <= 0 or step % self.interval:
            return []
        mine = sum(self._times) / len(self._times)
        self._times = []
        per_rank = collectives.gather_floats(mine, self.group)
        self.last_report = per_rank
        slow = find_stragglers(per_rank, self.factor)
        median = statistics.median(per_rank)
        for r in slow:
            log.warning("straggler: rank %d took %.3f s per step over the last %d steps, %.1fx the median "
                        "%.3f s (threshold %.1fx)", r, per_rank[r], self.interval, per_rank[r] / median, median,
                        self.factor)
        return slow
