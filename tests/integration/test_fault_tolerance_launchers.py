"""The launchers of replica groups under torchft, run as a user runs them. scripts/train_fault_tolerant.sbatch under a
fake SLURM (tests/support/workers/fake_slurm: srun runs its one task on this machine, scontrol names this machine
once per node): a job of 2 nodes runs the Lighthouse and 2 replica groups of 1 node, one srun job step each, real
torchrun agents and workers. scripts/launch_fault_tolerant.sh on one host: 2 groups. In both, the groups train
together to the end, the durable saves in the shared checkpoint folder, and end with bitwise equal weights (marked
rehearsal). Refused before any group starts (in the suite): a node count that does not split into groups, and a
Lighthouse address that something else listens on or holds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint.durable.discovery import Listing
from checkpoint.durable.manifest import read_manifest
from recovery.fault_tolerance import LOG_NAME
from rehearsal.processes import free_port, kill_tree
from support.launch import ROOT, WORKERS, subprocess_env
from support.replicas import overrides

pytestmark = pytest.mark.distributed
STEPS, INTERVAL = 6, 3


def _slurm_env(tmp_path: Path, nodes: int, **extra) -> dict:
    return subprocess_env({
        "PATH": f"{WORKERS / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), "SLURM_JOB_ID": "4343", "SLURM_JOB_NODELIST": "node[0-9]",
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": str(ROOT),
        # the sbatch puts group g's rendezvous at RDZV_PORT + g: a block of ports, none of them the Lighthouse's
        "RUN_DIR": str(tmp_path / "ft"), "RDZV_PORT": str(free_port(count=nodes)), "LIGHTHOUSE_PORT": str(free_port()),
        "JOIN_TIMEOUT_MS": "1000", "HEARTBEAT_TIMEOUT_MS": "1000", "GLOO_SOCKET_IFNAME": "lo",
        "MIN_REPLICAS": "2", **extra})  # no step without both groups, whichever starts first


@pytest.mark.rehearsal  # 4 cold Python starts (2 agents, 2 workers): about 40 s; .ci/run runs it after the suite
def test_the_fault_tolerant_sbatch_runs_one_srun_step_per_group(tmp_path, pydoc_data):
    run_dir = tmp_path / "ft"
    proc = subprocess.run(["bash", "scripts/train_fault_tolerant.sbatch", *_train_args(tmp_path, pydoc_data)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, env=_slurm_env(tmp_path, 2))
    assert proc.returncode == 0, proc.stderr[-6000:]
    calls = (tmp_path / "slurm.log").read_text().splitlines()
    steps = [c for c in calls if c.startswith("srun ")]  # in the order the two background steps logged them
    assert len(steps) == 2 and all(any(f"--rdzv-id 4343-group{g} " in c and f"fault_tolerance.replica_id={g} " in c and
                                       "parallel.fault_tolerance.hostname=127.0.0.1" in c and
                                       f"checkpoint.dir={run_dir}/checkpoints " in c for c in steps)
                                   for g in (0, 1)), steps
    _check_trained_together(run_dir)


@pytest.mark.rehearsal  # 4 cold Python starts (2 agents, 2 workers): about 40 s; .ci/run runs it after the suite
def test_the_one_host_launcher_runs_a_lighthouse_and_one_torchrun_per_group(tmp_path, pydoc_data):
    run_dir = tmp_path / "ft"
    proc = subprocess.run(["bash", "scripts/launch_fault_tolerant.sh", *_train_args(tmp_path, pydoc_data)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, env=_launcher_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-6000:]
    _check_trained_together(run_dir)


def _train_args(tmp_path: Path, data: Path) -> list:
    """The debug run's overrides for every group (the launchers give each its run_dir and checkpoint.dir)."""
    return [a for a in overrides(tmp_path / "unused", data, STEPS, {
        "checkpoint.interval": INTERVAL, "checkpoint.keep_last": 5,
        "+recovery.faults": "[{kind: slow, phase: step, step: -1, rank: -1, delay_s: 0.2}]"})
        if not a.startswith(("output_root=", "run_name="))]


def _launcher_env(tmp_path: Path, bind: str = "", **extra) -> dict:
    return subprocess_env({
        "PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "ft"), "GROUPS_N": "2", "NPROC": "1",
        "LIGHTHOUSE_BIND": bind or f"127.0.0.1:{free_port()}", "JOIN_TIMEOUT_MS": "1000",
        "HEARTBEAT_TIMEOUT_MS": "1000", "GLOO_SOCKET_IFNAME": "lo", "MIN_REPLICAS": "2", **extra})


def _check_trained_together(run_dir: Path) -> None:
    """Both groups trained every step together (min_replicas 2), every durable save was committed once in the shared
    folder, by group 0 (the first of each quorum), and the groups' weights are bitwise equal."""
    rows = [[json.loads(line) for line in (run_dir / f"group_{g}" / LOG_NAME).read_text().splitlines()]
            for g in (0, 1)]
    for g in (0, 1):
        committed_steps = [(r["step"], r["participants"]) for r in rows[g] if r["committed"]]
        assert committed_steps == [(step, 2) for step in range(1, STEPS + 1)], (g, committed_steps)
    committed = Listing(run_dir / "checkpoints").committed()
    assert sorted(c.step for c in committed) == list(range(INTERVAL, STEPS + 1, INTERVAL))
    digests = [json.loads((run_dir / f"group_{g}" / "weights-rank0.json").read_text()) for g in (0, 1)]
    assert digests[0]["weights_sha256"] == digests[1]["weights_sha256"]
    writers = {c.step: read_manifest(c.path).config["parallel"]["fault_tolerance"]["replica_id"] for c in committed}
    assert set(writers.values()) == {0}, writers


@pytest.mark.parametrize("stranger", ["listens", "holds"])
def test_a_lighthouse_address_in_use_is_refused_before_any_group_starts(tmp_path, stranger):
    """Something on the Lighthouse's port: one that listens would answer the launcher's wait in the Lighthouse's
    place, one that only holds the port makes the Lighthouse exit. Either way the launcher stops with status 1 and
    says why, before a group starts."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        if stranger == "listens":
            taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        proc = subprocess.run(["bash", "scripts/launch_fault_tolerant.sh", "+experiment=debug"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=_launcher_env(tmp_path, bind))
    assert proc.returncode == 1, proc.stderr[-3000:]
    expected = (f"something already listens on {bind}, the Lighthouse's address" if stranger == "listens" else
                f"exited with status 1 before it listened on {bind}")
    assert expected in proc.stderr and "no group started" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ft").exists()


def test_a_node_count_that_does_not_split_into_groups_is_refused(tmp_path):
    proc = subprocess.run(["bash", "scripts/train_fault_tolerant.sbatch", "+experiment=debug"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=_slurm_env(tmp_path, 3, NODES_PER_GROUP="2"))
    assert proc.returncode == 2
    assert "3 nodes (3 named) do not split into groups of NODES_PER_GROUP=2: ask for a multiple of it" in proc.stderr
    assert not any(c.startswith("srun ") for c in (tmp_path / "slurm.log").read_text().splitlines())


@pytest.mark.parametrize("launcher", ["scripts/launch_fault_tolerant.sh", "scripts/train_fault_tolerant.sbatch"])
def test_a_preemption_notice_while_the_lighthouse_starts_starts_no_group(tmp_path, launcher):
    """SIGTERM while the launcher waits for the Lighthouse (a stand-in that never listens): the wait ends at once
    and no group is started (before: the one-host launcher's trap had no group to pass it to and started them all
    afterwards; the sbatch had no trap yet and died without a requeue). The sbatch requeues the job, as for a notice
    during training."""
    started = tmp_path / "lighthouse-started"
    fake = tmp_path / "torchft_lighthouse"
    fake.write_text(f"#!/bin/bash\ntouch {started}\nexec sleep 120\n")
    fake.chmod(0o755)
    env = (_slurm_env(tmp_path, 2) if launcher.endswith(".sbatch") else _launcher_env(tmp_path))
    env["LIGHTHOUSE_BIN"] = str(fake)
    proc = subprocess.Popen(["bash", launcher, "+experiment=debug"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert "SIGTERM received while waiting for the Lighthouse; no group started" in err, err
    assert not (tmp_path / "ft").exists(), "a group was started"
    if launcher.endswith(".sbatch"):
        calls = (tmp_path / "slurm.log").read_text().splitlines()
        assert proc.returncode == 0 and "scontrol requeue 4343" in calls, (proc.returncode, calls, err)
        assert not any(c.startswith("srun ") for c in calls), calls
    else:
        assert proc.returncode == 1, (proc.returncode, err)
