"""A replacement node joins a running multi-node job launched by scripts/launch_multi_node.sh.

Two launcher agents on localhost act as two nodes (--nnodes 2, one rank each, c10d rendezvous on
127.0.0.1). Node 1 is lost at step 7 (its agent and its worker SIGKILLed): the survivor's worker
fails and its agent restarts it (TORCHELASTIC_RESTART_COUNT 1), while the replacement agent started
for node 1 counts from 0. With torch 2.13's shared store (the launcher's default before) neither got
as far as starting a worker: the replacement waited 60 s for round 1's MASTER_ADDR, which the
survivor never publishes again, the survivor for the replacement's role info, and both exited 1.
The job must re-form at world 2 with the replacement, resume from its newest checkpoint and finish."""

from __future__ import annotations

import sys
import time

import pytest

from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.processes import free_port
from rehearsal.runs import tiny_overrides
from support.launch import RDZV_KEEP_ALIVE, ROOT, load_script
from support.processes import start, stop

STEPS, INTERVAL, LOSS_STEP = 10, 2, 7
TIMEOUT_S = 60  # parallel.collective_timeout_s: a worker waiting for a peer that never comes fails after this


def _node(tmp_path, overrides, port: int, node: int, launch: int):
    """One node: scripts/launch_multi_node.sh as an operator runs it (node 0 hosts the rendezvous)."""
    env = {"RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port), "NNODES": "2", "NPROC": "1", "RUN_ID": "replace-test",
           "RDZV_IS_HOST": "true" if node == 0 else "false", "MAX_RESTARTS": "1", "JOIN_TIMEOUT_S": "120",
           "RDZV_CONF_EXTRA": RDZV_KEEP_ALIVE, "PYTHON": sys.executable}
    log = open(tmp_path / f"node{node}-{launch}.log", "w")
    try:
        return start(["bash", str(ROOT / "scripts" / "launch_multi_node.sh"), *overrides], log, extra_env=env,
                     start_new_session=True)
    finally:
        log.close()


def _logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp_path.glob("node*.log")))


@pytest.mark.distributed
def test_a_replacement_node_joins_the_survivors_and_the_job_finishes(tmp_path, pydoc_data):
    run_dir = tmp_path / "run"
    loss = faults_override([{"kind": "node_loss", "phase": "data_wait", "step": LOSS_STEP, "rank": 1}])
    overrides = tiny_overrides(run_dir, pydoc_data, STEPS, INTERVAL,
                               extra=[loss, f"parallel.collective_timeout_s={TIMEOUT_S}"])
    port = free_port()
    agents = []
    try:
        agents.append(_node(tmp_path, overrides, port, 0, 1))
        time.sleep(1.0)  # node 0 hosts the rendezvous store
        agents.append(_node(tmp_path, overrides, port, 1, 1))
        assert agents[1].wait(timeout=400) != 0, _logs(tmp_path)  # node 1 went down at step 7
        agents.append(_node(tmp_path, overrides, port, 1, 2))  # its replacement, restart count 0
        codes = [agents[0].wait(timeout=400), agents[2].wait(timeout=400)]
    finally:
        for agent in agents:
            stop(agent)
    assert codes == [0, 0], _logs(tmp_path)
    resumes = read_metrics(run_dir, "resume")
    # --nnodes 2: both agents exiting 0 is a world of 2 finishing; it resumed from a save before the loss
    # (step 6's asynchronous write may not have committed when the node went down)
    assert resumes and INTERVAL <= resumes[-1]["step"] < LOSS_STEP and resumes[-1]["saved_world_size"] == 2, resumes
    assert sorted(step_losses(run_dir)) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("argv, environ, store, notice", [
    (["--standalone", "--nproc-per-node=8"], {}, None, False),  # one agent: torch's shared store is right
    (["--nnodes=1", "--nproc-per-node=8", "--rdzv-endpoint=localhost:29400"], {}, None, False),
    (["--nnodes=60:64", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400"], {},
     "1", True),
    (["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400"],
     {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "GLOO_SOCKET_IFNAME": "ib0"}, "1", False),
])
def test_a_launch_that_may_span_nodes_gets_a_store_per_round_and_names_the_gloo_interface(
        argv, environ, store, notice):
    """What scripts/launch_multi_node.sh and scripts/train.sbatch leave to their agent (torchrun_preemptible)."""
    agent = load_script("torchrun_preemptible")
    environ = dict(environ)
    said = agent.multi_node_env([*argv, "train.py"], environ)
    assert environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == store
    assert (said is not None) == notice
    if notice:
        assert "GLOO_SOCKET_IFNAME is not set" in said and "docs/recovery-runbook.md" in said
