"""Intentional changes on resume (docs/training.md): the schedule follows the new config from the
resumed step, a refused change is an error that condemns nothing, and every checkpoint still
loads afterwards. Real train.py processes with the debug experiment's defaults (guards on)."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from checkpoint.durable.discovery import list_committed
from checkpoint.durable.manifest import FORMAT_VERSION, MANIFEST, read_manifest
from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support.launch import run_train
from training.schedule import schedule_lr

pytestmark = pytest.mark.distributed  # every test starts train.py

FIRST = 40  # steps of the first launch: past the guards' 20-step warm-up


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, pydoc_data):
    """A 40-step run saving every 10 steps (keep_last 2: steps 30 and 40 stay)."""
    run_dir = tmp_path_factory.mktemp("changes") / "run"
    run_train(debug_overrides(run_dir, pydoc_data, FIRST, {"checkpoint.interval": 10}))
    return run_dir


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("change", [
    {"training.steps": 60},
    {"training.steps": 60, "optim.lr": 1.0e-3, "optim.lr_min": 1.0e-4, "optim.warmup_steps": 5},
], ids=["extend", "new_lr"])
def test_resume_follows_the_new_schedule_and_marks_nothing_bad(first_run, pydoc_data, tmp_path, change):
    run_dir = _copy(first_run, tmp_path / "run")
    proc = run_train(debug_overrides(run_dir, pydoc_data, change["training.steps"],
                                     {"checkpoint.interval": 10, **change}))
    assert "resume changes the schedule" in proc.stderr and "training.steps: 40 -> 60" in proc.stderr
    [resumed] = read_metrics(run_dir, "resume")
    assert resumed["checkpoint_id"] == "step_00000040" and resumed["skipped"] == []
    optim = OmegaConf.create({"lr": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"})
    for key, value in change.items():
        if key.startswith("optim."):
            optim[key.split(".", 1)[1]] = value
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in range(FIRST + 1, 61):  # row "step" is 1-based; the LR of its update is the schedule's at step - 1
        assert rows[step]["lr"] == schedule_lr(optim, 60, step - 1), f"step {step}"
    assert all(c.bad is None for c in list_committed(run_dir / "checkpoints", include_bad=True))
    assert [c.step for c in list_committed(run_dir / "checkpoints")] == [60, 50]


REFUSED = [  # (a change a resume refuses, how the refusal names it)
    ({"model.n_layers": 3}, "model.n_layers: 2 -> 3"),
    ({"seed": 99}, "seed: 1234 -> 99"),
    ({"training.seq_len": 32}, "training.seq_len: 64 -> 32"),
]


def test_a_refused_change_condemns_nothing_and_every_checkpoint_still_loads(first_run, pydoc_data, tmp_path):
    """A change of the model shape, the seed or the data order is refused with exit 2, naming the
    change and the flag that allows it; after all three refusals in the same run directory nothing
    is marked BAD, and each checkpoint still resumes, verified, with the original settings."""
    run_dir = _copy(first_run, tmp_path / "run")
    for change, named in REFUSED:
        proc = run_train(debug_overrides(run_dir, pydoc_data, 50, {"checkpoint.interval": 10, **change}), check=False)
        assert proc.returncode == 2, (change, proc.stderr[-3000:])
        assert named in proc.stderr and "checkpoint.allow_config_change=true" in proc.stderr, change
        assert "Traceback" not in proc.stderr
        committed = list_committed(run_dir / "checkpoints", include_bad=True)
        assert [c.step for c in committed] == [40, 30] and all(c.bad is None for c in committed), change
    for step in (30, 40):  # each one still resumes, verified, with the original settings
        proc = run_train(debug_overrides(run_dir, pydoc_data, FIRST, {"checkpoint.interval": 10,
                                                                      "checkpoint.resume": step}))
        # step 40, saved again by the resume from 30, is a revision of it (step_00000040.r1): a re-save never
        # rewrites a committed checkpoint
        assert re.search(rf"post-load verification of step_{step:08d}(\.r\d+)? passed", proc.stderr), step


def test_a_new_global_batch_is_accepted_with_both_flags(first_run, pydoc_data, tmp_path):
    run_dir = _copy(first_run, tmp_path / "run")
    change = {"checkpoint.interval": 10, "training.global_batch_size": 16}
    refused = run_train(debug_overrides(run_dir, pydoc_data, 50, change), check=False)
    assert refused.returncode == 2 and "training.global_batch_size: 8 -> 16" in refused.stderr
    run_train(debug_overrides(run_dir, pydoc_data, 50, {**change, "checkpoint.allow_config_change": "true",
                                                        "recovery.allow_global_batch_change": "true"}))
    [resumed] = read_metrics(run_dir, "resume")
    assert resumed["checkpoint_id"] == "step_00000040"
    manifest = read_manifest(run_dir / "checkpoints" / "step_00000050")
    assert manifest.samples == 40 * 8 + 10 * 16 and manifest.global_batch_size == 16


def test_a_checkpoint_of_a_newer_format_is_refused_and_kept(first_run, pydoc_data, tmp_path):
    """A run directory shared with a newer checkout: its checkpoint's manifest names a format this
    checkout does not know. The resume must stop with exit 2, naming both formats, with or without
    allow_config_change; it must not fall back to the older checkpoint (that would go back in
    training), mark anything bad or remove anything."""
    run_dir = _copy(first_run, tmp_path / "run")
    manifest_path = run_dir / "checkpoints" / "step_00000040" / MANIFEST
    text = manifest_path.read_text()
    assert f'"format_version": {FORMAT_VERSION}' in text
    manifest_path.write_text(text.replace(f'"format_version": {FORMAT_VERSION}',
                                          f'"format_version": {FORMAT_VERSION + 1}'))
    for extra in ({}, {"checkpoint.allow_config_change": "true"}):
        proc = run_train(debug_overrides(run_dir, pydoc_data, 50, {"checkpoint.interval": 10, **extra}), check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert (f"manifest format {FORMAT_VERSION + 1}; this checkout reads formats up to {FORMAT_VERSION}"
                in proc.stderr), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and read_metrics(run_dir, "resume") == []
        committed = list_committed(run_dir / "checkpoints", include_bad=True)
        assert [c.step for c in committed] == [40, 30] and all(c.bad is None for c in committed)
        assert manifest_path.read_text().count(f'"format_version": {FORMAT_VERSION + 1}') == 1
