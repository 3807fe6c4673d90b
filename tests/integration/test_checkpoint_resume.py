"""Kill-and-resume on real processes: bitwise continuation, and each state component is needed.

One reference run (9 steps, EMA, saves at 3, 6, 9) is shared; every other run is compared
with it. Losses and learning rates must be *bitwise* equal after a resume at the same layout
(CPU, fp32), and must differ when one state component is left out. Dropout runs (the RNG
component) have their own reference. The runs (tests/support/workers/ckpt_runner.py) and the comparisons
are in support/resume.py, shared with test_checkpoint_reshard.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrics.records import read_metrics
from support.resume import assert_bitwise_continuation, committed_steps, per_step, resumed_step, run

pytestmark = pytest.mark.distributed  # every test trains through train.py processes


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pydoc_data) -> Path:
    run_dir = tmp_path_factory.mktemp("ckpt") / "reference"
    run(run_dir, pydoc_data)
    assert committed_steps(run_dir) == [9, 6, 3]
    return run_dir


def test_sync_crash_between_write_and_commit_resumes_bitwise(reference, pydoc_data, tmp_path):
    run_dir = tmp_path / "crash"
    run(run_dir, pydoc_data, "--kill-before-commit", "6", expect_kill=True)
    root = run_dir / "checkpoints"
    assert (root / "step_00000006" / "acks").is_dir()  # written and acknowledged, not committed
    assert not (root / "step_00000006" / "manifest.json").exists()
    assert committed_steps(run_dir) == [3]
    assert (root / "latest").read_text().strip() == "step_00000003"

    proc = run(run_dir, pydoc_data)
    assert resumed_step(run_dir) == 3
    assert "resume: from" in proc.stderr and "step_00000003" in proc.stderr
    # the leftover was removed at start-up, so the new save of step 6 took its name again
    assert (root / "step_00000006" / "manifest.json").is_file() and not list(root.glob("step_00000006.r*"))
    assert_bitwise_continuation(run_dir, reference, 3)
    assert committed_steps(run_dir) == [9, 6, 3]
    ema, ref_ema = (ema_weights(d / "checkpoints" / "step_00000009") for d in (run_dir, reference))
    assert all(torch.equal(ema[k], ref_ema[k]) for k in ref_ema)


def test_async_kill_during_write_resumes_bitwise(reference, pydoc_data, tmp_path):
    run_dir = tmp_path / "async"
    run(run_dir, pydoc_data, "--kill-after-save", "6", extra={"checkpoint.async_mode": "async"}, expect_kill=True)
    assert 3 in committed_steps(run_dir)  # the save of step 3 finished before step 6's began
    run(run_dir, pydoc_data, extra={"checkpoint.async_mode": "async"})
    start = resumed_step(run_dir)
    assert start in (3, 6)  # 6 only if its write and commit beat the SIGKILL
    assert_bitwise_continuation(run_dir, reference, start)
    saves = read_metrics(run_dir, "checkpoint")
    assert saves and all(e["mode"] == "async" and e["blocking_s"] >= 0 and e["background_s"] > 0 for e in saves)


def ema_weights(checkpoint: Path) -> dict:
    from checkpoint.interop.export import load_tensors

    return load_tensors(checkpoint, prefix="ema.")


@pytest.mark.parametrize("component", ["scheduler", "optim", "data", "ema"])
def test_each_component_is_needed(component, reference, pydoc_data, tmp_path):
    """Resume from the reference's step 6 with one component left out of the checkpoint.

    The full resume reproduces the reference bitwise (the crash tests above), so any
    difference here comes from the missing component."""
    run_dir = tmp_path / f"drop-{component}"
    proc = run(run_dir, pydoc_data, "--drop", component, expect_fail=component == "data", extra={
        "checkpoint.resume": str(reference / "checkpoints" / "step_00000006"),
        "recovery.verify": "false"})  # recovery's post-load checks would refuse some of these
    if component == "data":  # the pipeline refuses to hand out step 7's batch from position 0
        assert "the trainer asks for step 6, but the data pipeline is at step 0" in proc.stderr
        return
    got, ref = per_step(run_dir), per_step(reference)
    assert resumed_step(run_dir) == 6
    losses, ref_losses = [got[s]["loss"] for s in (7, 8, 9)], [ref[s]["loss"] for s in (7, 8, 9)]
    lrs, ref_lrs = [got[s]["lr"] for s in (7, 8, 9)], [ref[s]["lr"] for s in (7, 8, 9)]
    if component == "scheduler":
        assert lrs != ref_lrs
    elif component == "ema":  # EMA never feeds back into training: only the EMA weights differ
        ema, ref_ema = (ema_weights(d / "checkpoints" / "step_00000009") for d in (run_dir, reference))
        assert losses == ref_losses
        assert not all(torch.equal(ema[k], ref_ema[k]) for k in ref_ema)
    else:
        assert losses != ref_losses


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory, pydoc_data):
    """Dropout 0.1: a reference, and resumes from its step 6 with and without the RNG state."""
    base = tmp_path_factory.mktemp("dropout")
    drop = {"model.dropout": 0.1}
    run(base / "ref", pydoc_data, extra=drop)
    resume = {**drop, "checkpoint.resume": str(base / "ref" / "checkpoints" / "step_00000006")}
    run(base / "keep", pydoc_data, extra=resume)
    run(base / "drop", pydoc_data, "--drop", "rng", extra={**resume, "recovery.verify": "false"})
    return {name: per_step(base / name) for name in ("ref", "keep", "drop")}


def test_rng_is_needed_with_dropout(dropout_runs):
    keep, drop = dropout_runs["keep"], dropout_runs["drop"]
    assert [keep[s]["loss"] for s in (7, 8, 9)] != [drop[s]["loss"] for s in (7, 8, 9)]


def test_dropout_resume_is_bitwise(dropout_runs):
    keep, ref = dropout_runs["keep"], dropout_runs["ref"]
    assert [keep[s]["loss"] for s in (7, 8, 9)] == [ref[s]["loss"] for s in (7, 8, 9)]


def test_grad_scaler_is_needed_with_fp16(pydoc_data, tmp_path):
    """fp16 with a short growth interval, so the loss scale moves during the run."""
    fp16 = {"training.mixed_precision": "fp16"}
    ref, dropped = tmp_path / "fp16-ref", tmp_path / "fp16-drop"
    run(ref, pydoc_data, "--scaler-growth-interval", "2", extra=fp16)
    resume = {**fp16, "checkpoint.resume": str(ref / "checkpoints" / "step_00000006"), "recovery.verify": "false"}
    run(dropped, pydoc_data, "--scaler-growth-interval", "2", "--drop", "scaler", extra=resume)
    r, d = per_step(ref), per_step(dropped)
    assert [d[s]["loss"] for s in (7, 8, 9)] != [r[s]["loss"] for s in (7, 8, 9)]


def test_changed_config_is_refused(reference, pydoc_data, tmp_path):
    proc = run(tmp_path / "beta2", pydoc_data, expect_fail=True, extra={
        "optim.beta2": "0.99", "checkpoint.resume": str(reference / "checkpoints" / "step_00000006")})
    assert "different config" in proc.stderr and "optim.beta2: 0.95 -> 0.99" in proc.stderr
