"""What one training step costs in synchronisation: at most one host sync and at most two
collectives of the product's own per step (FSDP's and TP's aside), counted on a real 2-rank run of
the debug experiment as a user runs it (guards on), long enough to pass every warm-up (the LR's
and the guards' 20 steps). The counting worker is tests/workers/step_counts.py.

The one collective after backward carries the loss and every layer's gradient norm (the guards
and the clipping norm read it: training/grad_stats.py); the one at the step's end carries the
flags every rank must agree on (preemption, a failed save, the automatic intervals); the host
reads the first once. The global token count comes from the data pipeline, not a collective.
"""

from __future__ import annotations

import json

import pytest

from helpers.launch import run, torchrun, worker
from metrics.records import read_metrics

STEPS = 30

pytestmark = pytest.mark.distributed


def test_a_step_syncs_once_and_issues_two_collectives(tmp_path, pydoc_data):
    out, run_dir = tmp_path / "counts.json", tmp_path / "run"
    proc = run(torchrun(2, worker("step_counts"), str(out), "train.py", "+experiment=debug",
                        f"output_root={tmp_path}", f"run_name={run_dir.name}", f"data.path={pydoc_data}",
                        "data.prepare_if_missing=false", f"training.steps={STEPS}"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert sorted(counts) == list(range(1, STEPS + 1))
    busy = {e["step"] for kind in ("checkpoint", "eval") for e in read_metrics(run_dir, kind)}
    assert busy == {STEPS}  # the final evaluation and save: not a plain step
    for step, c in counts.items():
        if step in busy:
            continue
        assert sum(c["collectives"].values()) <= 2, (step, c)
        assert sum(c["syncs"].values()) <= 1, (step, c)
    assert counts[1]["collectives"] == {"all_reduce": 1, "agree_max": 1}, counts[1]
    assert counts[1]["syncs"] == {"tolist": 1}, counts[1]
