"""Reading a run's metrics.jsonl back: one row per step (no "kind") and event rows with a
"kind" (checkpoint, resume, rollback, alarm, ...). Torch-free, for tools, scripts and tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

METRICS_FILE = "metrics.jsonl"


def read_rows(run_dir: Path | str) -> List[dict]:
    """Every row of ``run_dir``/metrics.jsonl in order; [] when the run wrote none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path | str, kind: Optional[str] = None) -> List[dict]:
    """The per-step rows (``kind=None``), or the event rows of one kind."""
    return [r for r in read_rows(run_dir) if r.get("kind") == kind]


def step_losses(run_dir: Path | str) -> Dict[int, float]:
    """step -> loss as logged (a re-run step logged twice keeps its last value)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}
