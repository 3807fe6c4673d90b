"""Kill-and-resume on real processes: bitwise continuation, and each state component is needed.

One reference run (9 steps, EMA, saves at 3, 6, 9) is shared; every other run is compared
with it. Losses and learning rates must be *bitwise* equal after a resume at the same layout
(CPU, fp32), and must differ when one state component is left out. Dropout runs (the RNG
component) have their own reference.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _env, debug_overrides, read_metrics

STEPS = 9
EXTRA = {"model.dropout": 0.0, "training.ema_decay": 0.9, "checkpoint.interval": 3, "checkpoint.keep_last": 5}


def run(run_dir: Path, data: Path, *runner_args: str, extra=None, nproc: int = 1, expect_kill=False,
        expect_fail=False) -> subprocess.CompletedProcess:
    overrides = debug_overrides(run_dir, data, steps=STEPS, extra={**EXTRA, **(extra or {})})
    script = [str(ROOT / "tests" / "ckpt_runner.py"), *runner_args, "--", *overrides]
    cmd = [sys.executable, *script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if expect_kill:
        assert proc.returncode in (-signal.SIGKILL, 1), proc.stderr[-3000:]  # torchrun reports a child's SIGKILL as 1
    elif expect_fail:
        assert proc.returncode != 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def per_step(run_dir: Path) -> dict:
    """{step: row}, the last row written for each step (a resumed run rewrites later steps)."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def resumed_step(run_dir: Path) -> int:
    events = read_metrics(run_dir, "resume")
    assert events, "no resume event in metrics.jsonl"
    return events[-1]["step"]


def assert_bitwise_continuation(run_dir: Path, reference: Path, start: int) -> None:
    got, ref = per_step(run_dir), per_step(reference)
    for step in range(start + 1, STEPS + 1):
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step]["loss"], ref[step]["loss"])
        assert got[step]["lr"] == ref[step]["lr"], step


def committed_steps(run_dir: Path) -> list:
    from checkpoint.discovery import list_committed

    return [c.step for c in list_committed(run_dir / "checkpoints")]


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
    assert (root / "step_00000006.uncommitted" / "acks").is_dir()  # written and acknowledged, not committed
    assert committed_steps(run_dir) == [3]
    assert (root / "latest").read_text().strip() == "step_00000003"

    proc = run(run_dir, pydoc_data)
    assert resumed_step(run_dir) == 3
    assert "resume: from" in proc.stderr and "step_00000003" in proc.stderr
    assert not (root / "step_00000006.uncommitted").exists()  # leftover cleaned at start-up
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
    from checkpoint.export import load_tensors

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
    proc = run(tmp_path / "lr", pydoc_data, expect_fail=True, extra={
        "optim.lr": "0.001", "checkpoint.resume": str(reference / "checkpoints" / "step_00000006")})
    assert "different config" in proc.stderr and "optim.lr: 0.003 -> 0.001" in proc.stderr
