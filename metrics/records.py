"""Reading a run's metrics.jsonl back: one row per step (no "kind") and event rows with a
"kind" (checkpoint, resume, rollback, alarm, ...). Torch-free, for tools, scripts and tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

METRICS_FILE = "metrics.jsonl"


def read_rows(run_dir: Path | str, stale: bool = False) -> List[dict]:
    """Every row of ``run_dir``/metrics.jsonl in order; [] when the run wrote none. Rows carry the attempt
    that wrote them (checkpoint/durable/lease.py); once a newer attempt has written, the rows an older one
    still writes are a stale writer's (the newer one owns the run) and are left out unless ``stale``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows, newest = [], 0
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            attempt = row.get("attempt")
            if attempt is not None and attempt < newest and not stale:
                continue
            newest = max(newest, attempt or 0)
            rows.append(row)
    return rows


def read_metrics(run_dir: Path | str, kind: Optional[str] = None) -> List[dict]:
    """The per-step rows (``kind=None``), or the event rows of one kind."""
    return [r for r in read_rows(run_dir) if r.get("kind") == kind]


def step_losses(run_dir: Path | str) -> Dict[int, float]:
    """step -> loss as logged (a re-run step logged twice keeps its last value)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}
