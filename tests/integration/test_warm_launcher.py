"""The tests' warm parent (support/warm.py) starts runs that behave as cold ones: the same view of
the process, exit codes, signals, torchrun's environment for ranks, and bitwise the same training."""

import json
import signal
import subprocess
import sys
import time

import pytest

from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support import warm
from support.launch import run, run_train, subprocess_env, torchrun, worker

PROBE = worker("warm_probe")


def _reports(stdout: str) -> list:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def test_a_forked_run_sees_what_a_cold_one_sees():
    env = subprocess_env({"WARM_PROBE": "seen", "OMP_NUM_THREADS": "2"})
    cold = run([sys.executable, PROBE, "3"], env=env, warm=False)
    forked = warm.run([sys.executable, PROBE, "3"], env=env)
    assert cold.returncode == forked.returncode == 3
    assert cold.stderr == forked.stderr == "to stderr\n"
    a, b = _reports(cold.stdout)[0], _reports(forked.stdout)[0]
    assert a.pop("pid") != b.pop("pid")
    assert a == b and b["probe"] == "seen" and b["threads"] == 2 and b["name"] == "__main__"
    assert b["stdout_line_buffered"] is False  # a pipe or file, as for a cold process


def test_forked_ranks_get_torchruns_environment_and_stop_together():
    t0 = time.monotonic()
    proc = warm.run(torchrun(2, PROBE, "5", "1", "60"), timeout=50)  # rank 1 fails at once, rank 0 sleeps
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 30, "rank 0 was not stopped when rank 1 failed"
    reports = _reports(proc.stdout)
    assert [(r["rank"], r["world"], r["local_world"]) for r in reports] == [(0, "2", "2"), (1, "2", "2")]
    assert "rank 1" in proc.stderr and "exited with 5" in proc.stderr


def test_a_forked_run_dies_of_a_real_sigkill(tmp_path):
    with open(tmp_path / "log", "w") as log:
        proc = warm.popen([sys.executable, PROBE, "0", "-1", "60"], stdout=log, stderr=subprocess.STDOUT)
        time.sleep(0.5)
        assert proc.poll() is None
        proc.kill()
        assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_training_forked_is_bitwise_training_cold(tmp_path, pydoc_data, nproc):
    """The property every other test relies on: a forked run trains exactly as a cold one (python
    for one process, real torchrun for two)."""
    losses = {}
    for how in ("cold", "forked"):
        run_dir = tmp_path / how
        run_train(debug_overrides(run_dir, pydoc_data, steps=4, extra={"checkpoint.interval": 2}), nproc=nproc,
                  warm=how == "forked")
        losses[how] = [r["loss"] for r in read_metrics(run_dir)]
        assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert len(losses["cold"]) == 4 and losses["cold"] == losses["forked"]


def test_only_plain_launches_are_forked():
    """A torchrun flag beyond --standalone --nproc-per-node (restarts, rendezvous) means the agent is
    under test: such a command, and python with interpreter flags, start cold."""
    assert warm.parse(torchrun(2, "train.py", "seed=1")) == (["train.py", "seed=1"], 2)
    assert warm.parse([sys.executable, "-m", "rehearsal.supervisor", "a"]) == (["-m", "rehearsal.supervisor", "a"], 1)
    assert warm.parse(torchrun(1, "--max-restarts=2", "train.py")) is None
    assert warm.parse([sys.executable, "-c", "print(1)"]) is None
    assert warm.parse(["bash", "scripts/launch_single_node.sh"]) is None
