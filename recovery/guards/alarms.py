"""Where alarms go: the log, metrics.jsonl (kind "alarm") and a JSON record in the run dir."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from recovery.guards.detectors import Anomaly

log = logging.getLogger("trainer")


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


class AlarmSink:
    def __init__(self, run_dir: Path | str, rank: int, metrics=None):
        self.dir = Path(run_dir) / "alarms"
        self.rank = rank
        self.metrics = metrics
        self.raised: List[Alarm] = []

    def raise_alarm(self, alarm: Alarm) -> None:
        self.raised.append(alarm)
        where = "" if alarm.ranks is None else f" (alarmed on rank(s) {alarm.ranks})"
        log.warning("ALARM step %d [%s] -> %s%s: %s", alarm.step, alarm.check, alarm.action, where, alarm.describe())
        if self.metrics is not None:
            self.metrics.log_event(alarm.step, kind="alarm", check=alarm.check, action=alarm.action,
                                   detail=alarm.describe(), ranks=alarm.ranks)
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            record = {"step": alarm.step, "check": alarm.check, "action": alarm.action, "rank": self.rank,
                      "alarmed_on_ranks": alarm.ranks,
                      "host": socket.gethostname(), "time": time.time(),
                      "anomalies": [asdict(a) for a in alarm.anomalies]}
            path = self.dir / f"step{alarm.step:08d}-{alarm.check}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
            os.replace(tmp, path)
