"""Preemption under torchrun and SLURM: the notice goes to the launcher, never to the workers.

SIGTERM (through scripts/launch_single_node.sh) or SIGUSR1 to the torchrun agent of a 2-rank
job: both ranks save the same step, the checkpoint commits, the job exits 0 within
recovery.preemption_grace_s, and the resumed run is bitwise the uninterrupted one. SIGTERM to
scripts/train.sbatch's batch shell (fake srun/scontrol on PATH, one node: tests/support/workers/fake_slurm)
goes shell -> srun -> agent -> workers, and the script requeues the job. The runs are 30 steps,
past the guards' 20-step warm-up, with the default config otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import divergences, faults_override
from rehearsal.processes import free_port
from rehearsal.runs import tiny_overrides
from support.launch import ROOT, WORKERS, run_train, subprocess_env
from support.processes import start, stop, wait_for_faults

STEPS, STALL, INTERVAL = 30, 24, 10
GRACE_S = 60


def _overrides(run_dir, data):
    # every rank stalls 3 s at step STALL: the moment to deliver the notice
    stall = faults_override([{"kind": "hang", "phase": "step", "step": STALL, "rank": -1, "hang_s": 3.0}])
    return tiny_overrides(run_dir, data, STEPS, INTERVAL, extra=[stall, f"recovery.preemption_grace_s={GRACE_S}"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pydoc_data):
    run_dir = tmp_path_factory.mktemp("preempt") / "baseline"
    run_train(tiny_overrides(run_dir, pydoc_data, STEPS, 0), nproc=2)
    return step_losses(run_dir)


def _signal_and_wait(job, sig, run_dir, log_path):
    wait_for_faults(run_dir, 2, job, log_path)
    job.send_signal(sig)
    sent = time.monotonic()
    try:
        code = job.wait(timeout=GRACE_S + 60)
    finally:
        stop(job)
    return code, time.monotonic() - sent


def _assert_saved_and_resumable(run_dir, log, overrides, baseline, sig_name):
    for rank in (0, 1):
        assert f"[rank{rank}] WARNING preemption ({sig_name}): saving step {STALL}" in log, log[-6000:]
        assert f"[rank{rank}] WARNING preemption: step {STALL} committed" in log, log[-6000:]
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert committed == [f"step_{s:08d}" for s in (2 * INTERVAL, STALL)], committed  # keep_last=2
    manifest = json.loads((run_dir / "checkpoints" / f"step_{STALL:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == STALL
    assert {name.split("_")[2] for name in manifest["files"] if name.endswith(".distcp")} == {"0", "1"}  # both ranks
    assert max(r["step"] for r in read_metrics(run_dir)) == STALL  # nothing trained after the notice
    run_train(overrides, nproc=2)  # the next start resumes (checkpoint.resume=auto)
    assert [e["checkpoint_id"] for e in read_metrics(run_dir, "resume")] == [f"step_{STALL:08d}"]
    assert divergences(baseline, run_dir) == []


@pytest.mark.distributed
def test_notice_to_the_torchrun_agent_saves_every_rank_and_exits_0(tmp_path, pydoc_data, baseline):
    """SIGUSR1 to scripts/launch_single_node.sh, which execs the agent (SIGTERM takes the same path: the
    sbatch test below sends it through srun to the agent)."""
    run_dir = tmp_path / "job"
    overrides = _overrides(run_dir, pydoc_data)
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:  # the launcher a user runs
        job = start(["bash", "scripts/launch_single_node.sh", *overrides], log,
                    {"NPROC": "2", "PYTHON": sys.executable})
        code, took = _signal_and_wait(job, signal.SIGUSR1, run_dir, log_path)
    text = log_path.read_text()
    assert code == 0, text[-6000:]
    assert took < GRACE_S, took
    assert "SIGUSR1: forwarded to workers" in text
    _assert_saved_and_resumable(run_dir, text, overrides, baseline, "SIGUSR1")


def _slurm_env(tmp_path, **extra):
    return {"PATH": f"{WORKERS / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
            "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[0]", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "2",
            "SLURM_SUBMIT_DIR": str(ROOT), "RDZV_PORT": str(free_port()), **extra}


@pytest.mark.distributed
def test_sbatch_passes_sigterm_down_and_requeues(tmp_path, pydoc_data, baseline):
    """The time-limit warning (--signal=B:TERM@180) reaches only the batch shell."""
    run_dir = tmp_path / "job"
    overrides = _overrides(run_dir, pydoc_data)
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = start(["bash", "scripts/train.sbatch", *overrides], log, _slurm_env(tmp_path))
        code, took = _signal_and_wait(job, signal.SIGTERM, run_dir, log_path)
    text = log_path.read_text()
    assert code == 0, text[-6000:]
    assert took < GRACE_S, took
    calls = (tmp_path / "slurm.log").read_text().splitlines()
    assert calls[-1] == "scontrol requeue 4242", calls
    assert "train.sbatch: SIGTERM received; passing it to srun" in text
    assert "--signal=B:TERM@180" in (ROOT / "scripts" / "train.sbatch").read_text()
    _assert_saved_and_resumable(run_dir, text, overrides, baseline, "SIGTERM")


@pytest.mark.parametrize("srun_exit", [0, 3])
def test_sbatch_without_a_notice_keeps_srun_status_and_does_not_requeue(tmp_path, srun_exit):
    env = subprocess_env(_slurm_env(tmp_path, FAKE_SRUN_EXIT=str(srun_exit)))
    proc = subprocess.run(["bash", "scripts/train.sbatch", "+experiment=debug"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == srun_exit, proc.stderr
    calls = (tmp_path / "slurm.log").read_text().splitlines()
    assert calls[0] == "scontrol show hostnames node[0]" and calls[1].startswith("srun --kill-on-bad-exit=1 ")
    assert not any("requeue" in c for c in calls), calls


@pytest.mark.parametrize("args, env, expected", [
    ([], {}, "150"),  # the default grace, 120 s, + 30 s
    (["recovery.preemption_grace_s=300"], {}, "330"),
    ([], {"GRACE_S": "45"}, "75"),
    (["recovery.preemption_grace_s=300"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "999"}, "999"),  # set by hand: kept
    (["recovery.preemption_grace_s=1e3"], {}, "1030"),
    (["recovery.preemption_grace_s=120.5"], {}, "150"),
    # not a number of seconds: nothing set, and no shell error: the launcher's config check refuses it (exit 2)
    (["recovery.preemption_grace_s=nan"], {}, ""),
    (["recovery.preemption_grace_s=inf"], {}, ""),
    (["recovery.preemption_grace_s=abc"], {}, ""),
    (["recovery.preemption_grace_s=-5"], {}, ""),
])
def test_launchers_give_the_agent_the_grace_period(args, env, expected):
    cmd = 'set -euo pipefail; source scripts/preemption_env.sh "$@"; echo "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}"'
    proc = subprocess.run(["bash", "-c", cmd, "bash", *args], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in {**subprocess_env(), **env}.items()
                               if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" or k in env}, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == expected and not proc.stderr, proc.stderr
    for script in ("launch_single_node.sh", "launch_multi_node.sh", "train.sbatch"):
        text = (ROOT / "scripts" / script).read_text()
        assert "source scripts/preemption_env.sh" in text and "scripts/torchrun_preemptible.py" in text, script


def test_workers_warn_when_torchrun_would_cut_the_grace_short():
    from recovery.runtime import torchrun_grace_problem

    assert torchrun_grace_problem(120, {}) is None  # not under torchrun
    problem = torchrun_grace_problem(120, {"TORCHELASTIC_RUN_ID": "x"})
    assert "30 s" in problem and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=150" in problem
    assert torchrun_grace_problem(120, {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "150"}) is None
