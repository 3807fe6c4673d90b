"""Two checkpoint tiers (durable storage, host memory with a peer replica): the Monte Carlo of
planner/simulate.py against the analytic goodput of scripts/plan_checkpointing.py, where a failure
restores from, and what bad input says."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.simulate import TwoTier, simulate_two_tier
from recovery.interval import cluster_mtbf_s, waste_fraction
from support.launch import load_script

plan = load_script("plan_checkpointing")

# A small ring for scripted timelines: a restore point every 10 s of training (stall 0.5 s), a durable
# save from every 10th (blocking 1 s, committed 5 s later), restart 10 s + 2 s from memory or + 50 s from storage.
RING = TwoTier(restart_s=10.0, durable_interval_s=100.0, durable_blocking_s=1.0, durable_write_s=5.0,
               durable_reload_s=50.0, memory_interval_s=10.0, memory_stall_s=0.5, memory_restore_s=2.0, nodes=4)


def scripted(failures, policy=RING):
    """One timeline of 300 s of training with exactly ``failures`` ((wall time, node) pairs)."""
    return simulate_two_tier(policy, mtbf_s=1e9, total_s=300.0, trials=1, failures=failures)


@pytest.mark.parametrize("devices", [1000, 10_000, 100_000])
def test_formula_matches_the_simulator_and_the_memory_tier_pays_off(devices):
    """70B at 10 GB/s with the planner's defaults (restart 300 s, 8 devices/node, stall from the host copy)."""
    args = plan.parser().parse_args(["--models", "70b", "--storage-gbps", "10", "--step-s", "2"])
    durable, two = plan.policies("70b", devices, 10.0, args)
    mtbf = cluster_mtbf_s(args.device_mtbf_hours, devices)
    sims = [simulate_two_tier(policy, mtbf, trials=5, seed=3) for policy in (durable, two)]
    for policy, sim in zip((durable, two), sims):
        assert sim.failures_per_trial > 1000
        assert sim.ratio == pytest.approx(plan.goodput(policy, mtbf), rel=0.01)
    assert plan.goodput(two, mtbf) > plan.goodput(durable, mtbf) and sims[1].ratio > sims[0].ratio


def test_formula_is_young_daly_to_first_order():
    m = 1e8  # failures rare: the exponential terms are linear
    durable = TwoTier(restart_s=300, durable_interval_s=600, durable_blocking_s=5, durable_write_s=60,
                      durable_reload_s=80, nodes=10)
    assert 1 - plan.goodput(durable, m) == pytest.approx(waste_fraction(600, 5, m, 380, 60), rel=1e-3)


def test_no_failures_costs_only_the_stalls():
    sim = scripted([])
    assert sim.failures_per_trial == 0
    # 29 snapshots (none after the last step) and durable saves at points 10 and 20
    assert sim.ratio == pytest.approx(300 / (300 + 29 * 0.5 + 2 * 1.0))


def test_a_node_loss_restores_from_memory():
    """Node 0 fails at 255 s (point 24 of 30 done at 254 s), node 2, not its neighbour, during its restart."""
    sim = scripted([(255.0, 0), (260.0, 2)])
    assert (sim.memory_restores_per_trial, sim.durable_restores_per_trial) == (2, 0)
    # the restart ends at 260 + 12; 6 more points, with 5 snapshots (none, and no save, after the last step)
    assert 300 / sim.ratio == pytest.approx(272 + 60 + 5 * 0.5)


def test_both_copies_lost_goes_to_storage():
    """Node 1 holds node 0's replica: losing it before node 0's state is snapshot again loses both copies."""
    sim = scripted([(255.0, 0), (260.0, 1)])
    assert (sim.memory_restores_per_trial, sim.durable_restores_per_trial) == (1, 1)
    assert sim.double_loss_fraction == 0.5
    # back to point 20 (durable save committed at 217 s), storage reload 50 s; 10 points to go
    assert 300 / sim.ratio == pytest.approx(260 + 60 + 100 + 9 * 0.5)
    # node 3 keeps its replica on node 0: its loss also leaves a rank with no copy
    assert scripted([(255.0, 0), (262.0, 3)]).durable_restores_per_trial == 1
    # once a snapshot completed after the restart (288 s), both copies exist again
    later = scripted([(255.0, 0), (290.0, 1)])
    assert (later.memory_restores_per_trial, later.durable_restores_per_trial) == (2, 0)


def test_zero_probability_double_loss_never_touches_storage():
    m = 3600.0
    slow = dataclasses.replace(RING, durable_reload_s=10_000.0)
    sims = [simulate_two_tier(p, m, trials=3, seed=5, double_loss_p=0.0) for p in (RING, slow)]
    assert sims[0].failures_per_trial > 1000
    assert all(s.durable_restores_per_trial == 0 and s.double_loss_fraction == 0 for s in sims)
    assert sims[0].ratio == sims[1].ratio  # the storage read never happens
    assert plan.goodput(RING, m, double_loss_p=0.0) == plan.goodput(slow, m, double_loss_p=0.0)
    every = simulate_two_tier(RING, m, trials=3, seed=5, double_loss_p=1.0)
    assert every.durable_restores_per_trial == every.failures_per_trial > 0
    assert every.ratio < sims[0].ratio


def test_double_loss_probability_matches_independent_node_failures():
    """A small ring that fails often, so that double losses are common enough to count."""
    for nodes, m in [(4, 600.0), (8, 1200.0)]:
        policy = dataclasses.replace(RING, restart_s=120.0, durable_interval_s=300.0, durable_blocking_s=10.0,
                                     durable_write_s=60.0, durable_reload_s=60.0, memory_interval_s=60.0,
                                     memory_stall_s=1.0, memory_restore_s=5.0, nodes=nodes)
        sim = simulate_two_tier(policy, m, trials=10, seed=2)
        p = plan.double_loss_probability(policy, m)
        assert 0.03 < p < 0.3
        assert sim.double_loss_fraction == pytest.approx(p, rel=0.1)
        assert sim.ratio == pytest.approx(plan.goodput(policy, m), rel=0.02)


def test_double_loss_probability_does_not_grow_with_scale():
    """P(both copies) ~ 2 x window x devices per node / device MTBF, whatever the device count: the rate of
    double losses grows with the cluster only because failures do. To second order the window is stretched
    by the failures inside it (W' = M (e^(w/M) - 1) ~ w (1 + w / 2M)): 8% at 100k devices (M = 30 min),
    where the window is mostly the 300 s restart (a snapshot, the host copy alone, every 1 s step)."""
    args = plan.parser().parse_args(["--models", "8b"])
    for devices in (1000, 10_000, 100_000):
        _, two = plan.policies("8b", devices, 10.0, args)
        mtbf = cluster_mtbf_s(args.device_mtbf_hours, devices)
        p = plan.double_loss_probability(two, mtbf)
        first_order = 2 * two.window_s * 8 / (args.device_mtbf_hours * 3600)
        assert p == pytest.approx(first_order * (1 + two.window_s / (2 * mtbf)), rel=0.02)
        assert p == pytest.approx(first_order, rel=0.15)


def test_plan_prints_the_two_tier_table(capsys):
    plan.main(["--models", "1b", "--storage-gbps", "1", "--no-plots", "--simulate", "--trials", "2"])
    out = capsys.readouterr().out
    assert "Two tiers: goodput" in out and "model outputs" in out
    args = plan.parser().parse_args(["--models", "1b", "--storage-gbps", "1"])
    for devices in (1000, 10_000, 100_000):
        durable, two = plan.policies("1b", devices, 1.0, args)
        mtbf = cluster_mtbf_s(args.device_mtbf_hours, devices)
        row = next(line for line in out.splitlines() if line.split()[:3] == ["1b", "1GB/s", str(devices)])
        assert f"{plan.goodput(durable, mtbf):.4f} {plan.goodput(two, mtbf):.4f}" in " ".join(row.split())
        assert row.split()[3] == str(math.ceil(devices / 8))


@pytest.mark.parametrize("change, message", [
    (dict(memory_stall_s=-1.0), "memory_stall_s=-1.0"),
    (dict(memory_interval_s=0.0), "memory_interval_s=0.0"),
    (dict(restart_s=float("nan")), "restart_s=nan"),
    (dict(nodes=1), "nodes=1"),
    (dict(nodes=2.5), "nodes=2.5"),
    (dict(memory_interval_s=None, durable_interval_s=2.0), "durable_interval_s=2.0"),
])
def test_bad_policy_names_the_value(change, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        dataclasses.replace(RING, **change)


def test_bad_simulation_input_names_the_value():
    with pytest.raises(ValueError, match=r"double_loss_p=1\.5"):
        simulate_two_tier(RING, 3600.0, double_loss_p=1.5)
    with pytest.raises(ValueError, match="mtbf_s=0"):
        simulate_two_tier(RING, 0)
    with pytest.raises(RuntimeError, match="below 0.1%"):  # restarts (12 s) never finish between failures (1 s)
        simulate_two_tier(RING, 1.0, total_s=100.0, trials=1)


@pytest.mark.parametrize("argv, message", [
    (["--memory-interval", "often"], "--memory-interval='often'"),
    (["--devices-per-node", "0"], "--devices-per-node=0"),
    (["--memory-stall-s", "-0.5"], "--memory-stall-s=-0.5"),
    (["--scales", "1000", "0"], "--scales 0"),
])
def test_bad_planner_options_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        plan.main(["--no-plots", *argv])
    assert message in capsys.readouterr().err


# -- replica groups under torchft (parallel.fault_tolerance; docs/recovery-runbook.md) -------------------------------
def test_replica_groups_lose_the_pause_a_step_and_the_out_groups_share():
    """A failure costs the survivors the pause and the step run again, then the job runs at (G - 1)/G of its rate
    until the group is back: the simulator agrees with 1 - (P + s + R/G) / M to first order, and without failures
    nothing is lost."""
    from planner.simulate import simulate_replica_groups

    mtbf = cluster_mtbf_s(50_000, 10_000)
    for groups in (8, 1250):
        res = simulate_replica_groups(groups, pause_s=5.0, rejoin_s=600.0, step_s=12.9, mtbf_s=mtbf, trials=10)
        formula = 1 - (5.0 + 12.9 + 600.0 / groups) / mtbf
        assert res.ratio == pytest.approx(formula, abs=3e-4), (groups, res, formula)
    idle = simulate_replica_groups(8, pause_s=5.0, rejoin_s=600.0, step_s=1.0, mtbf_s=1e15, total_s=1e4, trials=2)
    assert idle.ratio == 1.0 and idle.failures_per_trial == 0
