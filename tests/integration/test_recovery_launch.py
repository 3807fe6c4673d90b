"""Acceptance through the real entry points: an injected hang is detected by the watchdog
within its timeout + 2 s and torchrun's restart resumes the run; SIGTERM saves, commits and
exits cleanly, and the next start resumes from that save. Losses are compared bit for bit
with an uninterrupted run of the same config."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from metrics.records import read_metrics, step_losses
from recovery.watchdog import read_records
from rehearsal.chains import divergences, faults_override
from rehearsal.runs import tiny_overrides
from support.launch import ROOT, run, run_train, subprocess_env, torchrun

pytestmark = pytest.mark.distributed  # every test starts train.py, one under torchrun

STEPS = 12
HANG_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pydoc_data):
    run_dir = tmp_path_factory.mktemp("launch") / "baseline"
    run_train(tiny_overrides(run_dir, pydoc_data, STEPS, 0))
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_hangs_are_detected_in_time_and_torchrun_restarts_resume(tmp_path, pydoc_data, baseline):
    """First a background checkpoint write hangs (training goes on beating: only the write
    timer can see it), then after the restart the training loop itself hangs."""
    run_dir = tmp_path / "hang"
    write_timeout_s = 4.0
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, 2, async_mode="async", extra=[
        faults_override([{"kind": "hang", "phase": "checkpoint_write", "step": 2},
                         {"kind": "hang", "phase": "step", "step": 7}]),
        f"recovery.timeouts.step={HANG_TIMEOUT_S}", f"recovery.checkpoint_write_timeout_s={write_timeout_s}"])
    proc = run(torchrun(1, "--max-restarts=2", str(ROOT / "train.py"), *overrides), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    write, beat = read_records(run_dir)
    assert (write["kind"], write["phase"], write["step"]) == ("checkpoint_write", "checkpoint_write", 2)
    assert write_timeout_s < write["detected_at"] - write["last_beat_at"] <= write_timeout_s + 2.0
    assert (beat["kind"], beat["phase"], beat["step"], beat["rank"]) == ("heartbeat", "step", 7, 0)
    latency = beat["detected_at"] - beat["last_beat_at"]
    assert HANG_TIMEOUT_S < latency <= HANG_TIMEOUT_S + 2.0, latency
    stacks = sorted((run_dir / "watchdog").glob("*-stacks.txt"))
    assert len(stacks) == 2 and all("faults.py" in p.read_text() for p in stacks)  # the hung frames are named
    # the write never committed, so the first restart starts fresh; the second resumes
    [resumed] = read_metrics(run_dir, "resume")
    assert resumed["checkpoint_id"] in ("step_00000004", "step_00000006")
    assert divergences(baseline, run_dir) == []


def test_sigterm_saves_commits_exits_cleanly_and_resume_continues(tmp_path, pydoc_data, baseline):
    run_dir = tmp_path / "preempt"
    # a 3 s stall at step 6 gives the test a fixed moment to deliver SIGTERM
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, 0, extra=[
        faults_override([{"kind": "hang", "phase": "step", "step": 6, "hang_s": 3.0}]),
        "recovery.preemption_grace_s=60"])
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list((run_dir / "faults").glob("fired-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert time.monotonic() - sent < 60  # within the grace period
    assert "preemption (SIGTERM): saving step 6" in err and "step 6 committed" in err
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed == ["step_00000006"]
    assert json.loads((run_dir / "checkpoints" / "step_00000006" / "manifest.json").read_text())["step"] == 6
    assert max(r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())) == 6

    run_train(overrides)  # the next start: resume=auto
    assert [e["checkpoint_id"] for e in read_metrics(run_dir, "resume")] == ["step_00000006"]
    assert divergences(baseline, run_dir) == []


def test_auto_checkpoint_interval_is_measured_chosen_and_logged(tmp_path, pydoc_data):
    from checkpoint.config import AUTO_MEASURE_STEPS
    from recovery.interval import choose_interval_steps

    run_dir = tmp_path / "auto"
    steps = 40
    # the evaluation before each save (eval.interval is 50: no other evaluation before the last step) takes
    # 0.3 s more: it is part of what a save costs the training thread
    slow_eval = faults_override([{"kind": "slow", "phase": "eval", "step": -1, "rank": 0, "delay_s": 0.3}])
    proc = run_train(tiny_overrides(run_dir, pydoc_data, steps, "auto", keep_last=10, extra=[
        "recovery.device_mtbf_hours=0.0001", slow_eval]))  # a 0.36 s MTBF: the optimum falls inside this run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [ev] = [r for r in rows if r.get("kind") == "checkpoint_interval"]
    assert ev["blocking_s"] >= 0.3, ev
    again = choose_interval_steps(ev["step_s"], ev["blocking_s"], ev["write_s"], ev["mtbf_s"], max_steps=steps)
    assert ev["interval_steps"] == again.steps and ev["write_s"] > 0
    assert again.steps >= again.lower_bound_steps  # never more than one save in flight
    assert f"checkpoint.interval=auto: every {again.steps} steps" in proc.stderr
    saved = [r["step"] for r in rows if r.get("kind") == "checkpoint"]
    later = [s for s in saved if s > ev["step"] and s != steps]
    assert saved[0] == AUTO_MEASURE_STEPS and all(s % again.steps == 0 for s in later)
    # the chosen interval comes from timings (a loaded machine makes it longer): saves follow it
    # wherever it leaves room before the final save
    expected = [s for s in range(again.steps, steps, again.steps) if s > ev["step"]]
    assert later == expected
