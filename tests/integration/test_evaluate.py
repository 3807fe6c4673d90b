"""Validation in real runs: the same loss at every layout, no effect on training, the eval
watchdog phase, and val_loss in the checkpoints' manifests (train.py and torchrun, gloo, CPU).

Tolerance across layouts: 1e-6 relative (fp32; the per-rank sums group the tokens differently).
At the training run's own layout the worker's loss equals the run's logged val_loss bitwise.
"""

from __future__ import annotations

import json

import pytest

from checkpoint.durable.discovery import list_committed
from metrics.records import read_metrics
from recovery.watchdog import read_records
from rehearsal.chains import faults_override
from rehearsal.runs import debug_overrides
from support.launch import python_or_torchrun, run, run_train, worker

pytestmark = pytest.mark.distributed  # every test starts train.py or torchrun

REL_TOL = 1e-6


@pytest.fixture(scope="module")
def trained(pydoc_data, tmp_path_factory):
    """A 1-process debug run of 20 steps, evaluated every 10 and saved at step 20."""
    run_dir = tmp_path_factory.mktemp("eval") / "trained"
    run_train(debug_overrides(run_dir, pydoc_data, steps=20, extra={"checkpoint.interval": 20, "eval.interval": 10}))
    [ckpt] = list_committed(run_dir / "checkpoints")
    return run_dir, ckpt


@pytest.mark.parametrize("nproc, layout", [
    (1, []),
    (2, ["dp_shard=2"]),
    (2, ["tp=2", "loss_parallel=true"]),
])
def test_validation_loss_is_the_same_at_every_layout(trained, tmp_path, nproc, layout):
    run_dir, ckpt = trained
    out = tmp_path / "val.json"
    proc = run(python_or_torchrun(nproc, worker("eval_worker"), str(ckpt.path), str(out), *layout), timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads(out.read_text())
    logged = {r["step"]: r for r in read_metrics(run_dir, "eval")}[20]
    assert ckpt.manifest.val_loss == logged["val_loss"]
    assert got["tokens"] == logged["val_tokens"] == 8 * 8 * 64  # eval.batches x global batch x seq_len
    if nproc == 1:
        assert got["val_loss"] == logged["val_loss"], (got, logged)  # the trainer's own evaluation, bitwise
    rel = abs(got["val_loss"] - logged["val_loss"]) / logged["val_loss"]
    assert rel <= REL_TOL, (got, logged, rel)


def test_evaluation_does_not_change_training(pydoc_data, tmp_path):
    """Evaluating (every 3 steps, and before each save at 4 and 8) leaves every training number
    bitwise as without it, dropout included; each manifest records the val_loss of its step."""
    extra = {"model.dropout": 0.1, "checkpoint.interval": 4, "checkpoint.keep_last": 5, "eval.interval": 3}
    with_eval, without = tmp_path / "with_eval", tmp_path / "without"
    run_train(debug_overrides(with_eval, pydoc_data, steps=8, extra=extra))
    run_train(debug_overrides(without, pydoc_data, steps=8, extra={**extra, "data.validation": "none"}))
    a, b = read_metrics(with_eval), read_metrics(without)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == [(r["step"], r["loss"], r["grad_norm"]) for r in b]
    evals = {r["step"]: r["val_loss"] for r in read_metrics(with_eval, "eval")}
    assert sorted(evals) == [3, 4, 6, 8] and read_metrics(without, "eval") == []
    assert evals[8] < evals[3]
    saved_with, saved_without = list_committed(with_eval / "checkpoints"), list_committed(without / "checkpoints")
    assert [c.step for c in saved_with] == [c.step for c in saved_without] == [8, 4]
    for c, d in zip(saved_with, saved_without):
        assert c.manifest.val_loss == evals[c.step] and d.manifest.val_loss is None
        assert c.manifest.probe_loss == d.manifest.probe_loss  # the same weights


def test_a_hung_evaluation_is_caught_by_the_eval_timeout(pydoc_data, tmp_path):
    """The evaluation runs in the watchdog's "eval" phase, with its own timeout."""
    run_dir = tmp_path / "hang"
    timeout_s = 3.0
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=8, extra=[
        "eval.interval=4", f"recovery.timeouts.eval={timeout_s}",
        faults_override([{"kind": "hang", "phase": "eval", "step": 4, "hang_s": 120.0}])]), check=False, timeout=300)
    assert proc.returncode != 0
    [record] = read_records(run_dir)
    assert (record["kind"], record["phase"], record["step"]) == ("heartbeat", "eval", 4)
    assert timeout_s < record["detected_at"] - record["last_beat_at"] <= timeout_s + 2.0
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
