"""Lineage: a rollback, or an explicit resume to an older step, fences the trajectory it abandons.
The newer checkpoints are marked superseded (kept for people, never resumed by resume=auto, not in
keep_last) and the memory tier's newer snapshots are dropped, so a crash right after continues the
new trajectory: bitwise the losses of a run where the crash did not happen."""

from __future__ import annotations

import shutil

import pytest

from checkpoint.durable.discovery import list_checkpoints
from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run_train

pytestmark = pytest.mark.distributed

STEPS, FLIP = 14, 9  # the flip after step 9's backward; the shadow check of step 10 sees it
ROLLBACK = ["recovery.guards.shadow_interval=2", "recovery.guards.rollback_min_age_steps=4"]  # alarm 10 -> step 6
FLIP_FAULT = {"kind": "bitflip_param", "phase": "gradients", "step": FLIP, "param": "norm.weight"}


def _overrides(run_dir, data, faults, extra=()):
    return tiny_overrides(run_dir, data, STEPS, 2, keep_last=3, extra=[*ROLLBACK, *extra, faults_override(faults)])


def _superseded(run_dir):
    return sorted(c.checkpoint_id for c in list_checkpoints(run_dir / "checkpoints") if c.superseded)


def test_a_crash_after_a_rollback_continues_the_new_trajectory(tmp_path, pydoc_data):
    reference = tmp_path / "reference"
    run_train(_overrides(reference, pydoc_data, [FLIP_FAULT]))
    [rollback] = read_metrics(reference, "rollback")
    assert (rollback["step"], rollback["to_step"]) == (10, 6)
    run_dir = tmp_path / "killed"  # the same run, killed at step 8 of the new trajectory (its 2nd step 8)
    kill = {"kind": "sigkill", "phase": "step", "step": 8, "skip": 1}
    killed = run_train(_overrides(run_dir, pydoc_data, [FLIP_FAULT, kill]), check=False)
    assert killed.returncode != 0 and read_metrics(run_dir, "rollback")
    assert _superseded(run_dir) == ["step_00000008"]  # committed before the alarm, after the target
    run_train(_overrides(run_dir, pydoc_data, [FLIP_FAULT, kill]))  # resume=auto; both faults already fired
    # the rollback saved its target again (a revision of step 6: a re-save never rewrites a committed checkpoint)
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"].split(".")[0] == "step_00000006"
    assert step_losses(run_dir) == step_losses(reference)


def test_a_resume_to_an_older_step_fences_newer_checkpoints_and_snapshots(tmp_path, pydoc_data):
    """Memory snapshots every 2 steps, durable every 4: explicitly resumed to step 4 and killed at
    step 7, the next resume=auto must not return to the old run's step 8 checkpoint or its
    snapshots of steps 8..12."""
    shm, steps = tmp_path / "shm", 12

    def overrides(run_dir, *extra):
        # synchronous saves: the kill at step 11 finds step 8 committed however loaded the machine is
        return tiny_overrides(run_dir, pydoc_data, steps, 4, keep_last=5, async_mode="sync", extra=[
            "checkpoint.memory.interval=2", f"checkpoint.memory.root={shm / run_dir.name}", *extra])

    first = tmp_path / "first"
    run_train(overrides(first, faults_override([{"kind": "sigkill", "phase": "step", "step": 11}])), check=False)
    assert sorted(p.name for p in (first / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000008"]
    reference = tmp_path / "reference"  # the uninterrupted run from step 4 of the same checkpoints
    shutil.copytree(first, reference)
    run_train(overrides(reference, "checkpoint.resume=4"))
    run_dir = tmp_path / "again"
    shutil.copytree(first, run_dir)
    shutil.copytree(shm / first.name, shm / run_dir.name)
    killed = run_train(overrides(run_dir, "checkpoint.resume=4",
                                 faults_override([{"kind": "sigkill", "phase": "step", "step": 7}])), check=False)
    assert killed.returncode != 0 and _superseded(run_dir) == ["step_00000008"]
    # the old run's snapshots (steps 8, 10) are gone; the new trajectory's step 6 is there
    assert sorted(p.name for p in (shm / run_dir.name).glob("step_*") if int(p.name.split("_")[1]) > 4) == \
        ["step_00000006"]
    run_train(overrides(run_dir))  # resume=auto
    resumed = read_metrics(run_dir, "resume")[-1]
    assert resumed["step"] <= 6, resumed  # the new trajectory's snapshot (step 6), not the old step 8 or 10
    assert {s: x for s, x in step_losses(run_dir).items() if s > 4} == \
        {s: x for s, x in step_losses(reference).items() if s > 4}
