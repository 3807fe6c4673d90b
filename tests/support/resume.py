"""Kill-and-resume runs through tests/support/workers/ckpt_runner.py and their comparison, shared by
test_checkpoint_resume.py (one layout) and test_checkpoint_reshard.py (across layouts)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support.launch import python_or_torchrun, worker
from support.launch import run as run_command

STEPS = 9
EXTRA = {"model.dropout": 0.0, "training.ema_decay": 0.9, "checkpoint.interval": 3, "checkpoint.keep_last": 5}


def run(run_dir: Path, data: Path, *runner_args: str, extra=None, nproc: int = 1, expect_kill=False,
        expect_fail=False) -> subprocess.CompletedProcess:
    """train.py through ckpt_runner.py (``runner_args``: its interventions) for STEPS steps."""
    overrides = debug_overrides(run_dir, data, steps=STEPS, extra={**EXTRA, **(extra or {})})
    cmd = python_or_torchrun(nproc, worker("ckpt_runner"), *runner_args, "--", *overrides)
    proc = run_command(cmd, timeout=900)
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
    from checkpoint.durable.discovery import list_committed

    return [c.step for c in list_committed(run_dir / "checkpoints")]
