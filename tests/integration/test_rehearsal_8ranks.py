"""The many-rank rehearsal on CPU: 8 processes (dp_shard 4 x tp 2) of the debug model with the
default config (guards on), async saves, the memory tier, and both automatic intervals. A SIGKILL at
a seeded step and a resume, and a SIGTERM through the project's launcher: no hang, every committed
checkpoint complete, the resume bitwise equal to the uninterrupted 8-rank run, and the SIGTERM
run commits and exits 0 within the grace period."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from checkpoint.durable.discovery import list_committed
from metrics.records import read_metrics, step_losses
from rehearsal.chains import divergences, faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run_train
from support.processes import start, stop, wait_for_faults

# Not in the default run (pyproject.toml: -m "not rehearsal"): .ci/run runs it after the suite, `pytest -m rehearsal`.
pytestmark = [pytest.mark.distributed, pytest.mark.rehearsal]

NPROC, STEPS, GRACE_S, BOUND_S = 8, 20, 60, 400
KILL_STEP = random.Random(8).choice(range(10, 16))


def _overrides(run_dir, data, shm, faults=()):
    extra = ["parallel.dp_shard=4", "parallel.tp=2", "training.global_batch_size=8",
             "checkpoint.memory.interval=auto", f"checkpoint.memory.root={shm}",
             "recovery.device_mtbf_hours=0.0001",  # a short MTBF: the chosen intervals fall inside the run
             f"recovery.preemption_grace_s={GRACE_S}"] + ([faults_override(faults)] if faults else [])
    return tiny_overrides(run_dir, data, STEPS, "auto", keep_last=3, extra=extra)


def _assert_complete(run_dir):
    """Every committed checkpoint has every file its manifest lists, at its size, from all 8 ranks. A folder without
    a manifest is a save the kill caught in flight (its commit waits for the next step's probe loss and then for
    every rank's acknowledgement): not committed, left for the next start to remove."""
    committed = list_committed(run_dir / "checkpoints", include_bad=True, include_superseded=True)
    assert committed
    for d in (Path(c.path.local_path()) for c in committed):
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["world_size"] == NPROC
        for name, entry in manifest["files"].items():
            assert (d / name).stat().st_size == entry["size"], (d, name)
        assert {n.split("_")[2] for n in manifest["files"] if n.endswith(".distcp")} == {str(r) for r in range(NPROC)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pydoc_data):
    root = tmp_path_factory.mktemp("eight")
    run_train(_overrides(root / "reference", pydoc_data, root / "shm-reference"), nproc=NPROC, timeout=BOUND_S)
    losses = step_losses(root / "reference")
    assert sorted(losses) == list(range(1, STEPS + 1))
    chosen = {e["tier"] for e in read_metrics(root / "reference", "checkpoint_interval")}
    assert chosen == {"durable", "memory"}  # both automatic intervals were measured and set
    return root, losses


def test_sigkill_at_a_seeded_step_then_resume_is_bitwise(reference, pydoc_data):
    root, losses = reference
    run_dir, shm = root / "killed", root / "shm-killed"
    kill = {"kind": "sigkill", "phase": "step", "step": KILL_STEP, "rank": KILL_STEP % NPROC}
    killed = run_train(_overrides(run_dir, pydoc_data, shm, [kill]), nproc=NPROC, timeout=BOUND_S, check=False)
    assert killed.returncode != 0
    _assert_complete(run_dir)
    run_train(_overrides(run_dir, pydoc_data, shm, [kill]), nproc=NPROC, timeout=BOUND_S)  # resume=auto
    [resumed] = read_metrics(run_dir, "resume")
    assert resumed["step"] < KILL_STEP
    assert divergences(losses, run_dir) == []
    _assert_complete(run_dir)


def test_sigterm_through_the_launcher_commits_and_exits_0(reference, pydoc_data, tmp_path):
    root, losses = reference
    run_dir, stall = root / "preempted", 12
    overrides = _overrides(run_dir, pydoc_data, root / "shm-preempted",
                           [{"kind": "hang", "phase": "step", "step": stall, "rank": -1, "hang_s": 3.0}])
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = start([sys.executable, "scripts/torchrun_preemptible.py", "--standalone", f"--nproc-per-node={NPROC}",
                     "train.py", *overrides], log, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(GRACE_S + 30)})
        try:
            wait_for_faults(run_dir, NPROC, job, log_path, timeout=BOUND_S)
            job.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            code = job.wait(timeout=GRACE_S + 60)
        finally:
            stop(job)
    took, text = time.monotonic() - sent, log_path.read_text()
    assert code == 0 and took < GRACE_S, (code, took, text[-6000:])
    for rank in range(NPROC):
        assert f"[rank{rank}] WARNING preemption: step {stall} committed" in text, text[-6000:]
    assert max(r["step"] for r in read_metrics(run_dir)) == stall
    _assert_complete(run_dir)
    assert (run_dir / "checkpoints" / f"step_{stall:08d}" / "manifest.json").is_file()
    assert step_losses(run_dir) == {s: losses[s] for s in range(1, stall + 1)}  # bitwise, up to the notice
