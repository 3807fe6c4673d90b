"""Elastic restart: two torchrun agents on localhost act as two nodes (c10d rendezvous,
--nnodes 1:2). One agent is SIGKILLed with its worker; the survivor's group re-forms with
one rank, resumes from the newest verified checkpoint with grad_accum_steps recomputed so
the global batch is unchanged, and the losses continue to match the uninterrupted 2-rank
run within RTOL (a different reduction order; bitwise before the kill)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.processes import free_port, kill_tree
from rehearsal.runs import tiny_overrides
from support.launch import RDZV_KEEP_ALIVE, ROOT, run_train, subprocess_env

STEPS, INTERVAL = 16, 2
RTOL = 1e-5  # parallel/ measured FSDP2 at 2 ranks vs 1 to ~5e-7


def _agent(overrides, port: int, is_host: bool, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout=5,join_timeout=120,{RDZV_KEEP_ALIVE}",
           "--max-restarts=3", "--monitor-interval=0.5", str(ROOT / "train.py"), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.distributed
def test_losing_a_node_reforms_smaller_group_with_same_global_batch(tmp_path, pydoc_data):
    base_dir = tmp_path / "baseline"
    run_train(tiny_overrides(base_dir, pydoc_data, STEPS, 0), nproc=2)
    baseline = step_losses(base_dir)

    run_dir = tmp_path / "elastic"
    # every rank stalls 8 s at step 9 (after the step-8 save): the moment to lose a node
    stall = faults_override([{"kind": "hang", "phase": "step", "step": 9, "rank": -1, "hang_s": 8.0}])
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, INTERVAL, keep_last=3,
                               extra=[stall, "recovery.timeouts.step=60"])
    port = free_port()
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    host = _agent(overrides, port, True, logs[0])
    time.sleep(0.5)
    other = _agent(overrides, port, False, logs[1])
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if len(list((run_dir / "faults").glob("fired-*"))) == 2:  # both ranks are in the stall
                break
            assert host.poll() is None and other.poll() is None, "an agent exited early"
            time.sleep(0.05)
        else:
            pytest.fail("the 2-node run did not reach step 9")
        kill_tree(other.pid)  # the node is gone: its agent and its worker
        other.wait()
        assert host.wait(timeout=600) == 0, (tmp_path / "agent0.log").read_text()[-6000:]
    finally:
        for p in (host, other):
            if p.poll() is None:
                kill_tree(p.pid)
        for f in logs:
            f.close()

    log = (tmp_path / "agent0.log").read_text()
    resumes = read_metrics(run_dir, "resume")
    assert resumes and resumes[-1]["saved_world_size"] == 2, log[-4000:]
    assert "elastic resume: checkpoint saved at world 2" in log and "grad_accum_steps recomputed to 2" in log
    assert "global batch stays 4" in log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_resume = max(i for i, r in enumerate(rows) if r.get("kind") == "resume")
    before = [r for r in rows[:last_resume] if "kind" not in r]  # trained at 2 ranks
    after = [r for r in rows[last_resume:] if "kind" not in r]  # at 1 rank, accumulating 2 micro-batches
    assert before and after and after[0]["step"] == resumes[-1]["step"] + 1
    for r in before:
        assert r["loss"] == baseline[r["step"]], r
    for r in after:
        assert abs(r["loss"] - baseline[r["step"]]) <= RTOL * abs(baseline[r["step"]]), (r, baseline[r["step"]])
    assert sorted({r["step"] for r in before + after}) == list(range(1, STEPS + 1))
