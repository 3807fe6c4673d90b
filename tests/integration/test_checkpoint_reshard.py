"""Checkpoints across world layouts (real torchrun, gloo, CPU).

Same layout (dp_shard=2): SIGKILL during an async write, resume: bitwise equal losses.
Different layouts: a checkpoint saved at one layout resumes at another (dp_shard 2 -> 1,
1 -> 2, 2 -> 4; tp 2 -> 1; dp_shard 2 x tp 2 -> dp_shard 4), model, optimizer and EMA
resharded by DCP, and training continues like the uninterrupted run at the saved layout.

Tolerance for a changed layout: |loss - reference| <= 1e-5 * loss at each of steps 7..9
(only the order of floating-point reductions differs: FSDP/TP vs one process agree to
~1e-6 per step, and Adam amplifies last-bit differences a little over three steps).
"""

from __future__ import annotations

import pytest

from support.resume import assert_bitwise_continuation, committed_steps, per_step, resumed_step, run

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (processes, overrides)
    "single": (1, {}),
    "dp_shard2": (2, {"parallel.dp_shard": 2}),
    "dp_shard4": (4, {"parallel.dp_shard": 4}),
    "tp2": (2, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "dp_shard2_tp2": (4, {"parallel.tp": 2, "parallel.dp_shard": 2}),
}
COMMON = {"training.micro_batch_size": 2}  # valid at dp 1, 2 and 4 (grad accumulation 4, 2, 1)
RTOL = 1e-5


def run_layout(run_dir, data, layout, *runner_args, extra=None, **kw):
    nproc, overrides = LAYOUTS[layout]
    return run(run_dir, data, *runner_args, extra={**COMMON, **overrides, **(extra or {})}, nproc=nproc, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pydoc_data):
    """Uninterrupted runs at the layouts that checkpoints are taken from (created on first use)."""
    base = tmp_path_factory.mktemp("layouts")
    done = {}

    def get(layout):
        if layout not in done:
            run_layout(base / layout, pydoc_data, layout)
            assert committed_steps(base / layout) == [9, 6, 3]
            done[layout] = base / layout
        return done[layout]

    return get


def test_async_kill_and_resume_at_two_ranks_is_bitwise(saved, pydoc_data, tmp_path):
    reference = saved("dp_shard2")
    run_dir = tmp_path / "killed"
    async_mode = {"checkpoint.async_mode": "async"}
    run_layout(run_dir, pydoc_data, "dp_shard2", "--kill-after-save", "6", extra=async_mode, expect_kill=True)
    run_layout(run_dir, pydoc_data, "dp_shard2", extra=async_mode)
    start = resumed_step(run_dir)
    assert start in (3, 6)
    assert_bitwise_continuation(run_dir, reference, start)


@pytest.mark.parametrize("source, target", [("dp_shard2", "single"), ("single", "dp_shard2"),
                                            ("dp_shard2", "dp_shard4"), ("tp2", "single"),
                                            ("dp_shard2_tp2", "dp_shard4")])
def test_resharded_resume_continues_within_tolerance(source, target, saved, pydoc_data, tmp_path):
    reference = saved(source)
    run_dir = tmp_path / f"{source}-to-{target}"
    run_layout(run_dir, pydoc_data, target,
               extra={"checkpoint.resume": str(reference / "checkpoints" / "step_00000006")})
    assert resumed_step(run_dir) == 6
    got, ref = per_step(run_dir), per_step(reference)
    for step in (7, 8, 9):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= RTOL * ref[step]["loss"], (step, got[step], ref[step])
        assert got[step]["lr"] == ref[step]["lr"]
