"""The guards' running statistics are part of the training state. With the default config
(guards on, skip_step, a 20-step warm-up), runs killed after the warm-up and resumed are bitwise
equal to the uninterrupted run, including the step a guard skips; without the guards' state a
resumed run would be warming up again and let that step through.

The decisive step is a silent gradient corruption (one flipped exponent bit, fault
``bitflip_grad``) a few steps after the last resume: fewer than the warm-up, so only restored
statistics can catch it.
"""

from __future__ import annotations

import json
import random
import sys

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import divergences, faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run
from support.resume import run as run_resume

pytestmark = pytest.mark.distributed  # training processes, SIGKILL

STEPS, INTERVAL, FLIP = 80, 10, 75
FLIP_FAULT = {"kind": "bitflip_grad", "phase": "gradients", "step": FLIP}


def _kill_steps(seed: int):
    """Two kills anywhere after the warm-up, then one in (60, 70]: the last resume is from step 60,
    15 steps (< the 20-step warm-up) before the corrupted gradient."""
    rng = random.Random(seed)
    return sorted(rng.sample(range(31, 61), 2)) + [rng.randint(62, 70)]


@pytest.mark.parametrize("seed", [13])
def test_kills_after_the_warmup_resume_bitwise_with_guards_on(tmp_path, pydoc_data, seed):
    kills = [{"kind": "sigkill", "phase": "step", "step": s} for s in _kill_steps(seed)]
    spec = [{"name": name, "max_restarts": len(faults) - 1,
             "overrides": tiny_overrides(tmp_path / name, pydoc_data, STEPS, INTERVAL, keep_last=3,
                                         extra=[faults_override(faults)])}
            for name, faults in (("baseline", [FLIP_FAULT]), ("killed", kills + [FLIP_FAULT]))]
    spec_path, out = tmp_path / "spec.json", tmp_path / "results.json"
    spec_path.write_text(json.dumps(spec))
    proc = run([sys.executable, "-m", "rehearsal.supervisor", str(spec_path), str(out)], timeout=900)
    assert out.exists() and proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert [a["returncode"] for a in results["killed"]["attempts"]] == [-9, -9, -9, 0]
    alarms = read_metrics(tmp_path / "baseline", "alarm")
    assert [(a["step"], a["check"], a["action"]) for a in alarms] == [(FLIP, "grad_norm", "skip_step")]
    assert read_metrics(tmp_path / "killed", "alarm")[-1]["step"] == FLIP  # the resumed run skipped it too
    resumes = [e["checkpoint_id"] for e in read_metrics(tmp_path / "killed", "resume")]
    assert resumes[-1] == "step_00000060"
    assert divergences(step_losses(tmp_path / "baseline"), tmp_path / "killed") == []


def test_the_guards_state_is_needed(tmp_path, pydoc_data):
    """Resume the same run from step 60 with and without the guards' component: only the full
    resume skips the corrupted step 75 as the uninterrupted run does."""
    extra = {"training.steps": STEPS, "checkpoint.interval": INTERVAL, "checkpoint.keep_last": 10,
             "+recovery.faults": f"[{{kind: bitflip_grad, phase: gradients, step: {FLIP}}}]"}
    reference = tmp_path / "reference"
    run_resume(reference, pydoc_data, extra=extra)
    resume = {**extra, "checkpoint.resume": str(reference / "checkpoints" / "step_00000060")}
    full, dropped = tmp_path / "full", tmp_path / "dropped"
    run_resume(full, pydoc_data, extra=resume)
    run_resume(dropped, pydoc_data, "--drop", "guards", extra=resume)
    ref = step_losses(reference)
    assert [step_losses(full)[s] for s in range(61, STEPS + 1)] == [ref[s] for s in range(61, STEPS + 1)]
    assert [a["step"] for a in read_metrics(dropped, "alarm")] == []  # warming up again: step 75 went through
    assert [step_losses(dropped)[s] for s in range(76, STEPS + 1)] != [ref[s] for s in range(76, STEPS + 1)]

