"""Checkpoint-interval math: Young/Daly, the auto choice, and the simulator agreeing with
the first-order formula."""

from __future__ import annotations

import math

import pytest

from configs.keys import step_count_or_auto
from planner.simulate import simulate
from recovery.interval import (
    choose_interval_steps,
    cluster_mtbf_s,
    waste_fraction,
    young_daly_interval_s,
)
from support.launch import load_script


def test_young_daly_minimises_the_first_order_waste():
    m, c, r = 5 * 3600.0, 30.0, 300.0
    t = young_daly_interval_s(m, c)
    assert t == pytest.approx(math.sqrt(2 * m * c))
    best = min((waste_fraction(x, c, m, r), x) for x in range(60, 6000, 5))[1]
    assert abs(best - t) / t < 0.05  # blocking/(T+C) shifts the optimum by O(C/T)


def test_cluster_mtbf_scales_with_devices():
    assert cluster_mtbf_s(50_000, 1000) == pytest.approx(50 * 3600)
    assert cluster_mtbf_s(50_000, 10_000) == pytest.approx(5 * 3600)
    # 10x the devices -> sqrt(10) x more frequent checkpoints
    ratio = young_daly_interval_s(cluster_mtbf_s(50_000, 1000), 10) / young_daly_interval_s(
        cluster_mtbf_s(50_000, 10_000), 10)
    assert ratio == pytest.approx(math.sqrt(10))


def test_auto_interval_is_bounded_below_by_the_background_write():
    # tiny blocking time: Young/Daly says "every 3 steps", but the write takes 8 steps
    choice = choose_interval_steps(step_s=0.1, blocking_s=1e-5, write_s=0.75, mtbf_s=200.0)
    assert choice.steps == 8 and choice.lower_bound_steps == 8
    assert "background write" in choice.reason
    free = choose_interval_steps(step_s=1.0, blocking_s=2.0, write_s=0.5, mtbf_s=3600.0)
    assert free.steps == round(math.sqrt(2 * 3600 * 2))


def test_parse_interval():
    parse_interval = lambda value: step_count_or_auto(value, "checkpoint.interval")  # noqa: E731
    assert parse_interval("auto") == "auto" and parse_interval(100) == 100 and parse_interval("20") == 20
    with pytest.raises(ValueError, match="auto"):
        parse_interval("often")
    with pytest.raises(ValueError, match=">= 0"):
        parse_interval(-1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_simulator_matches_formula_and_penalises_bad_intervals(asynchronous):
    m, c, r, w = 3600.0, 20.0, 120.0, (60.0 if asynchronous else 0.0)
    t = young_daly_interval_s(m, c)
    sim = simulate(t, c, r, m, write_s=w, asynchronous=asynchronous, trials=10, seed=1)
    formula = 1 - waste_fraction(t, c, m, r, w)
    assert abs(sim.ratio - formula) < 0.02
    too_often = simulate(t / 10, c, r, m, write_s=w, asynchronous=asynchronous, trials=10, seed=1)
    too_rare = simulate(t * 10, c, r, m, write_s=w, asynchronous=asynchronous, trials=10, seed=1)
    assert sim.ratio > too_often.ratio and sim.ratio > too_rare.ratio


def test_simulator_without_failures_costs_only_the_checkpoints():
    sim = simulate(100.0, 1.0, 10.0, mtbf_s=1e12, total_s=10_000, trials=1)
    assert sim.failures_per_trial == 0
    assert sim.ratio == pytest.approx(10_000 / (10_000 + 99 * 1.0))


def test_plan_checkpointing_table_and_plot(tmp_path, capsys):
    plan = load_script("plan_checkpointing")
    plan.main(["--models", "1b", "--storage-gbps", "10", "--intervals-min", "30", "--devices", "1000",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    params = plan.model_params("1b")
    # a sync save blocks for the probe (the planner's: 4 x 8192 tokens of forward) and the write
    probe = plan.save("1b", 1000, 10.0, plan.parser().parse_args([])).probe_s
    assert 0.1 < probe < 1.0  # ~0.3 s at 1B on the planner's H100
    c_sync = probe + params * 12 / 10e9
    row = next(line for line in out.splitlines() if "30 min" in line)
    assert f"{100 * c_sync / (1800 + c_sync):.3f}%" in row  # sync overhead C / (T + C)
    assert f"{1800 / 2 + 300:.0f} s" in row  # work lost per failure: T/2 + R
    t_star = young_daly_interval_s(cluster_mtbf_s(50_000, 1000), c_sync)
    assert any("T* sync" in line and f"{t_star:.0f}" in line for line in out.splitlines())
    assert (tmp_path / "checkpoint_waste_1b.png").read_bytes()[:4] == b"\x89PNG"
