"""Where the c10d rendezvous store lives decides which node the job can lose.

Two torchrun agents on localhost act as two nodes (--nnodes 1:2, one rank each). With the
store in the agent at --rdzv-endpoint (is_host=true, what a plain multi-node launch does),
losing that node ends the job: the other agent exits non-zero and its worker is gone.
(Losing the other node re-forms the job at world 1: tests/integration/test_recovery_elastic.py.) With the
store in its own process (scripts/rendezvous_store.py, both agents is_host=false), losing the
node that was started first, the one that hosted the store before, re-forms the job at world 1
and it finishes."""

from __future__ import annotations

import json
import sys
import time

import pytest

from metrics.records import read_metrics
from rehearsal.chains import faults_override
from rehearsal.processes import free_port, kill_tree
from rehearsal.runs import tiny_overrides
from support.launch import RDZV_KEEP_ALIVE
from support.processes import alive, children, start, stop, wait_for_faults

pytestmark = pytest.mark.distributed

STEPS, INTERVAL, STALL = 16, 2, 9


def _agent(overrides, port: int, is_host: bool, log):
    return start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                  "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=store-test",
                  f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout=5,join_timeout=120,"
                  f"{RDZV_KEEP_ALIVE}",
                  "--max-restarts=3", "--monitor-interval=0.5", "train.py", *overrides], log,
                 start_new_session=True)


def _lose_node(agent) -> None:
    """The node is gone: its agent and its worker, at once."""
    kill_tree(agent.pid)
    agent.wait()


def _two_nodes(tmp_path, pydoc_data, port, first_hosts: bool):
    run_dir = tmp_path / "job"
    stall = faults_override([{"kind": "hang", "phase": "step", "step": STALL, "rank": -1, "hang_s": 8.0}])
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, INTERVAL, keep_last=3,
                               extra=[stall, "recovery.timeouts.step=60"])
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    first = _agent(overrides, port, first_hosts, logs[0])
    time.sleep(0.5)
    second = _agent(overrides, port, False, logs[1])
    wait_for_faults(run_dir, 2, second, tmp_path / "agent1.log")  # both ranks stall at step 9
    return run_dir, first, second, logs


def test_losing_the_node_whose_agent_hosts_the_store_ends_the_job(tmp_path, pydoc_data):
    run_dir, host, other, logs = _two_nodes(tmp_path, pydoc_data, free_port(), first_hosts=True)
    try:
        workers = children(other.pid)
        _lose_node(host)
        lost = time.monotonic()
        code = other.wait(timeout=600)
        ended_after = time.monotonic() - lost
    finally:
        for p in (host, other):
            stop(p)
        for f in logs:
            f.close()
    log = (tmp_path / "agent1.log").read_text()
    assert code != 0, log[-4000:]
    assert not any(alive(w) for w in workers)
    resumes = read_metrics(run_dir, "resume")
    assert not resumes, resumes  # it never re-formed
    print(f"store's node lost: the other agent exited {code} after {ended_after:.1f} s")  # the runbook's number


def test_with_the_store_in_its_own_process_losing_either_node_reforms(tmp_path, pydoc_data):
    port = free_port()
    with open(tmp_path / "store.log", "w") as store_log:
        store = start([sys.executable, "scripts/rendezvous_store.py", "--host", "127.0.0.1", "--port", str(port)],
                      store_log)
        deadline = time.monotonic() + 120
        while "listening" not in (tmp_path / "store.log").read_text():
            assert store.poll() is None and time.monotonic() < deadline, (tmp_path / "store.log").read_text()
            time.sleep(0.1)
        run_dir, first, second, logs = _two_nodes(tmp_path, pydoc_data, port, first_hosts=False)
        try:
            _lose_node(first)  # the node that would have hosted the store
            code = second.wait(timeout=600)
        finally:
            for p in (first, second, store):
                stop(p)
            for f in logs:
                f.close()
    log = (tmp_path / "agent1.log").read_text()
    assert code == 0, log[-6000:]
    resumes = read_metrics(run_dir, "resume")
    assert resumes and resumes[-1]["saved_world_size"] == 2, log[-4000:]
    assert "elastic resume: checkpoint saved at world 2" in log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "kind" not in r) == STEPS
