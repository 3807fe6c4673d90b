"""Real training through train.py: the data split and the data resume do not change the run.

Two data-parallel ranks each read half of every global batch (data/batching.py) and
accumulate two micro-batches; one rank reads all of it in four. The token loss is
normalised by the global target count (training/step.py), so losses may differ only by
floating-point summation order: the tests allow 1e-5 relative per step (measured: 3e-8).
The two-rank run loads with 2 worker processes and checkpoints at step 3; a one-rank run
with 3 workers resumes from that checkpoint: its steps 4..6 must match both the
uninterrupted two-rank run and a one-rank run that never stopped.
"""

import pytest

from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support.launch import run_train

STEPS = 6
RTOL = 1e-5
COMMON = {"training.global_batch_size": 8, "training.micro_batch_size": 2, "training.seq_len": 32,
          "data.cross_document_loss": "false", "checkpoint.keep_last": 5}


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def assert_close(got: dict, want: dict, steps, what: str) -> None:
    for step in steps:
        a, b = got[step], want[step]
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: {what}: {a} vs {b}"


@pytest.fixture(scope="module")
def runs(pydoc_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("data_train")
    dp2, dp1, resumed = root / "dp2", root / "dp1", root / "dp1_resumed"
    run_train(debug_overrides(dp2, pydoc_data, steps=STEPS, extra={
        **COMMON, "data.num_workers": 2, "checkpoint.interval": 3}), nproc=2)
    run_train(debug_overrides(dp1, pydoc_data, steps=STEPS, extra=COMMON), nproc=1)
    proc = run_train(debug_overrides(resumed, pydoc_data, steps=STEPS, extra={
        **COMMON, "data.num_workers": 3, "checkpoint.resume": str(dp2 / "checkpoints" / "step_00000003")}))
    return losses(dp2), losses(dp1), losses(resumed), proc.stderr


@pytest.mark.distributed
def test_losses_match_between_dp2_accum2_and_dp1_accum4(runs):
    two, one, _, _ = runs
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    assert two[1] > 3.0  # a real loss on real bytes (ln 257 = 5.55 at init), not a constant
    assert_close(two, one, range(1, STEPS + 1), "dp=2 x accum=2 vs dp=1 x accum=4")


@pytest.mark.distributed
def test_resume_at_another_dp_and_worker_count_continues_the_run(runs):
    two, one, resumed, log = runs
    assert "data resumes at step 3, global sample 24" in log
    assert sorted(resumed) == [4, 5, 6]
    assert_close(resumed, two, range(4, STEPS + 1), "resumed at dp=1 / 3 workers vs uninterrupted dp=2")
    assert_close(resumed, one, range(4, STEPS + 1), "resumed at dp=1 / 3 workers vs uninterrupted dp=1")
