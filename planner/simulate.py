"""Failure simulator: what fraction of wall time a job spends on new training.

Monte Carlo over a timeline with exponentially distributed failures (cluster MTBF M):
compute for T seconds, checkpoint (blocking C; with async saving the write then commits W
seconds later while training continues); a failure loses everything after the last
*committed* checkpoint and costs the recovery time R (detection, restart, load, first
step: the MTTR that scripts/bench_recovery.py measures). The effective training time
ratio is useful work / wall time. It checks the first-order formula in recovery/interval.py
and includes what the formula leaves out (failures during saves, lost in-flight writes).

Two tiers (``simulate_two_tier``): a durable tier as above, plus in-memory snapshots every
T_m seconds that stall C_m and leave each rank's state in its node's host memory and in a
replica on the next node of a ring. Failures are losses of independent nodes (cluster MTBF M,
a uniformly chosen node each time; failures also strike during restarts). A node loss restores
from memory: the restart overhead plus a memory/peer read, back to the last snapshot. Only when
a ring neighbour of the lost node failed too since the last completed snapshot (both copies of
some rank's state gone) does the job reload from storage, back to the last committed durable
save. The analytic counterpart is ``goodput`` in scripts/plan_checkpointing.py.

Replica groups under torchft (``simulate_replica_groups``, parallel.fault_tolerance): a failure stops the
surviving groups for the measured pause and the step they run again; the lost group rejoins after the measured
rejoin time, and meanwhile the others train the whole global batch at (live groups / groups) of the rate.

    python -m planner.simulate --blocking-s 0.05 --write-s 0.4 --restart-s 12 --step-s 0.1
    python -m planner.simulate --blocking-s 0.05 --write-s 0.4 --restart-s 12 --step-s 0.1 \\
        --durable-reload-s 30 --memory-stall-s 0.05 --memory-restore-s 2 --devices-per-node 8
    python -m planner.simulate --blocking-s 0.03 --write-s 0.6 --restart-s 16.6 --step-s 0.14 \
        --ft-pause-s 5 --ft-rejoin-s 16.9 --devices 1000 10000 100000
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from typing import List, Optional, Sequence

from recovery.interval import (
    DEFAULT_DEVICE_MTBF_HOURS,
    choose_interval_steps,
    cluster_mtbf_s,
    waste_fraction,
    young_daly_interval_s,
)


@dataclass(frozen=True)
class SimResult:
    ratio: float  # useful work / wall time, mean over trials
    ratio_std: float
    failures_per_trial: float
    interval_s: float


def _one_trial(total_s: float, interval_s: float, blocking_s: float, write_s: float, restart_s: float,
               mtbf_s: float, asynchronous: bool, rng: random.Random) -> tuple:
    wall = done = committed = 0.0
    pending = None  # (commit wall time, work it makes durable)
    failures = 0
    fail_at = rng.expovariate(1.0 / mtbf_s)

    def settle(now: float) -> None:
        nonlocal committed, pending
        if pending is not None and pending[0] <= now:
            committed, pending = pending[1], None

    def advance(duration: float) -> bool:
        """Move the clock; on a failure inside the span roll back and return False."""
        nonlocal wall, done, pending, failures, fail_at
        if fail_at < wall + duration:
            settle(fail_at)
            pending = None
            failures += 1
            wall = fail_at + restart_s
            done = committed
            fail_at = wall + rng.expovariate(1.0 / mtbf_s)
            return False
        wall += duration
        settle(wall)
        return True

    while done < total_s:
        seg = min(interval_s, total_s - done)
        if not advance(seg):
            continue
        done += seg
        if done >= total_s:
            break
        if asynchronous and pending is not None and not advance(pending[0] - wall):  # wait for the last write
            continue
        if not advance(blocking_s):
            continue
        if asynchronous:
            pending = (wall + write_s, done)
        else:
            committed = done
    return total_s / wall, failures


def simulate(interval_s: float, blocking_s: float, restart_s: float, mtbf_s: float, write_s: float = 0.0,
             asynchronous: bool = True, total_s: float | None = None, trials: int = 20, seed: int = 0) -> SimResult:
    total_s = total_s if total_s is not None else 200 * mtbf_s  # ~200 failures per trial
    rng = random.Random(seed)
    out = [_one_trial(total_s, interval_s, blocking_s, write_s, restart_s, mtbf_s, asynchronous, rng)
           for _ in range(trials)]
    ratios: List[float] = [r for r, _ in out]
    return SimResult(statistics.fmean(ratios), statistics.pstdev(ratios),
                     statistics.fmean(f for _, f in out), interval_s)


def _check_seconds(name: str, value, positive: bool = False) -> None:
    """Reject what would silently yield a wrong table: negatives, NaN, infinities, non-numbers."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} must be a {'positive' if positive else 'non-negative'} "
                         f"finite number of seconds")


@dataclass(frozen=True)
class TwoTier:
    """A checkpoint policy with a durable tier and, optionally, a node-local memory tier with a peer replica.

    Durable: a save every ``durable_interval_s`` of training blocks ``durable_blocking_s`` and commits
    ``durable_write_s`` later; restarting from it costs ``restart_s`` plus ``durable_reload_s`` (the storage
    read). Memory (``memory_interval_s`` set): a snapshot every ``memory_interval_s`` stalls ``memory_stall_s``;
    restarting from it costs ``restart_s`` plus ``memory_restore_s`` (own host memory, or the peer's for the
    lost node). Durable saves are then taken at every ``durable_every``-th snapshot, and ``durable_blocking_s`` is
    what they add to that snapshot's stall."""

    restart_s: float
    durable_interval_s: float
    durable_blocking_s: float
    durable_write_s: float = 0.0
    durable_reload_s: float = 0.0
    memory_interval_s: Optional[float] = None
    memory_stall_s: float = 0.0
    memory_restore_s: float = 0.0
    nodes: int = 2

    def __post_init__(self):
        for name in ("restart_s", "durable_blocking_s", "durable_write_s", "durable_reload_s", "memory_stall_s",
                     "memory_restore_s"):
            _check_seconds(name, getattr(self, name))
        _check_seconds("durable_interval_s", self.durable_interval_s, positive=True)
        if self.memory_interval_s is not None:
            _check_seconds("memory_interval_s", self.memory_interval_s, positive=True)
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise ValueError(f"nodes={self.nodes!r} must be a whole number >= 1")
        if self.memory and self.nodes < 2:
            raise ValueError(f"nodes={self.nodes}: the memory tier keeps its replica on a peer node, it needs >= 2")
        if not self.memory and self.durable_write_s > self.durable_interval_s:
            raise ValueError(f"durable_interval_s={self.durable_interval_s!r} is shorter than the background write "
                             f"durable_write_s={self.durable_write_s!r}: a save would wait for the previous one "
                             f"(simulate() models that)")

    @property
    def memory(self) -> bool:
        return self.memory_interval_s is not None

    @property
    def segment_s(self) -> float:
        """Training between restore points: the memory interval, or the durable one without a memory tier."""
        return self.memory_interval_s if self.memory else self.durable_interval_s

    @property
    def durable_every(self) -> int:
        """k: durable saves are taken from every k-th snapshot, late enough that the previous write has committed."""
        if not self.memory:
            return 1
        t = self.memory_interval_s
        return max(1, round(self.durable_interval_s / t), math.ceil(self.durable_write_s / t - 1e-9))

    def stall_s(self, point: int) -> float:
        """Blocking time at restore point ``point`` (1, 2, ...): the snapshot, plus the durable save every k-th."""
        durable = self.durable_blocking_s if point % self.durable_every == 0 else 0.0
        return (self.memory_stall_s if self.memory else 0.0) + durable

    @property
    def mean_segment_wall_s(self) -> float:
        return self.segment_s + (self.memory_stall_s if self.memory else 0.0) + \
            self.durable_blocking_s / self.durable_every

    @property
    def peers_at_risk(self) -> int:
        """Nodes whose loss, on top of a lost node, leaves a rank without a copy: the ring neighbour that holds
        its replica and the one whose replica it held."""
        return min(2, self.nodes - 1)

    @property
    def window_s(self) -> float:
        """How long a lost node leaves its neighbours' states with one copy: restart, restore, and the next
        snapshot (training and stall) after it."""
        return self.restart_s + self.memory_restore_s + self.mean_segment_wall_s


@dataclass(frozen=True)
class Tally:
    wall_s: float
    work_s: float
    failures: int
    memory_restores: int
    durable_restores: int
    double_losses: int  # both copies of some rank's state lost: a subset of durable_restores


def _two_tier_trial(policy: TwoTier, total_s: float, mtbf_s: float, rng: random.Random,
                    double_loss_p: Optional[float] = None, failures: Optional[Sequence[tuple]] = None) -> Tally:
    """One timeline, failure to failure: between failures the schedule is deterministic, so where a failure
    lands (which snapshots completed, which durable writes committed) is arithmetic, not a walk over steps.

    Restore points are numbered 0, 1, 2, ... (``segment_s`` of training each). A run that restarted from point
    ``i0`` at wall time ``w0`` finishes point ``i`` (training and its stalls) at ``end(i)``; a durable save of
    point ``j`` commits at ``end(j) + durable_write_s``. A failure cancels the write in flight."""
    t, k, w_d = policy.segment_s, policy.durable_every, policy.durable_write_s
    mean = policy.mean_segment_wall_s
    c_m = policy.memory_stall_s if policy.memory else 0.0
    c_d = policy.durable_blocking_s
    n_end = max(1, math.ceil(total_s / t - 1e-9))
    i0, w0 = 0, 0.0
    mem_ok, dur_point, last_snapshot = True, 0, 0.0  # point 0 is the initial checkpoint, in both tiers
    last_fail: dict = {}
    n_fail = n_mem = n_dur = n_double = 0
    scripted = iter(sorted(failures)) if failures is not None else None
    give_up = 1000 * (total_s / mtbf_s + 10)  # restarts that never get a segment done

    def end(i: int) -> float:
        return w0 + (i - i0) * (t + c_m) + c_d * (i // k - i0 // k)

    def last_point(f: float, lag: float = 0.0) -> int:
        """The last point ``i`` (>= i0) with ``end(i) + lag <= f``."""
        i = min(max(i0, i0 + int((f - lag - w0) / mean)), n_end)
        while i < n_end and end(i + 1) + lag <= f:
            i += 1
        while i > i0 and end(i) + lag > f:
            i -= 1
        return i

    def next_failure(after: float) -> tuple:
        if scripted is not None:
            return next(scripted, (math.inf, 0))
        return after + rng.expovariate(1.0 / mtbf_s), rng.randrange(policy.nodes)

    fail_at, node = next_failure(0.0)
    while True:
        finish = end(n_end) - policy.stall_s(n_end)  # the last point's training done: no save needed after it
        if fail_at >= finish:
            break
        n_fail += 1
        if n_fail > give_up:
            raise RuntimeError(f"{n_fail} failures before {total_s:.0f} s of training (MTBF {mtbf_s:.0f} s): the "
                               f"goodput of {policy} is below 0.1%")
        point = i0
        if fail_at >= w0:  # during training: what completed since the restart
            point = last_point(fail_at)
            if point > i0:
                mem_ok, last_snapshot = True, end(point)
            committed = (last_point(fail_at, lag=w_d) // k) * k
            if committed > i0:
                dur_point = committed
        if double_loss_p is not None:
            double = rng.random() < double_loss_p
        else:
            neighbours = {(node - 1) % policy.nodes, (node + 1) % policy.nodes} - {node}
            double = any(last_fail.get(nb, -math.inf) > last_snapshot for nb in neighbours)
        last_fail[node] = fail_at
        if policy.memory and mem_ok and not double:
            n_mem += 1
            i0, w0 = point, fail_at + policy.restart_s + policy.memory_restore_s
        else:
            n_dur += 1
            n_double += bool(policy.memory and double)
            mem_ok = False  # the snapshot that was lost is gone; memory holds nothing until the next one
            i0, w0 = dur_point, fail_at + policy.restart_s + policy.durable_reload_s
        fail_at, node = next_failure(fail_at)
    return Tally(finish, n_end * t, n_fail, n_mem, n_dur, n_double)


@dataclass(frozen=True)
class TwoTierResult:
    ratio: float  # useful work / wall time (goodput), mean over trials
    ratio_std: float
    failures_per_trial: float
    memory_restores_per_trial: float
    durable_restores_per_trial: float
    double_loss_fraction: float  # of all failures: both copies lost, so the job read the durable tier


def simulate_two_tier(policy: TwoTier, mtbf_s: float, total_s: float | None = None, trials: int = 20, seed: int = 0,
                      double_loss_p: float | None = None, failures: Optional[Sequence[tuple]] = None) -> TwoTierResult:
    """Seeded Monte Carlo of ``policy`` under node failures with cluster MTBF ``mtbf_s``.

    ``double_loss_p`` replaces the ring of independent nodes by a coin with that probability per failure (0:
    the peer copy always survives); ``failures`` ((wall time, node) pairs) replaces the random failures of
    every trial."""
    _check_seconds("mtbf_s", mtbf_s, positive=True)
    if total_s is not None:
        _check_seconds("total_s", total_s, positive=True)
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials={trials!r} must be a whole number >= 1")
    if double_loss_p is not None and not (isinstance(double_loss_p, (int, float)) and 0 <= double_loss_p <= 1):
        raise ValueError(f"double_loss_p={double_loss_p!r} must be a probability in [0, 1]")
    total_s = total_s if total_s is not None else 2000 * mtbf_s  # ~2000 failures per trial
    rng = random.Random(seed)
    out = [_two_tier_trial(policy, total_s, mtbf_s, rng, double_loss_p, failures) for _ in range(trials)]
    ratios = [x.work_s / x.wall_s for x in out]
    n_fail = sum(x.failures for x in out)
    return TwoTierResult(statistics.fmean(ratios), statistics.pstdev(ratios), n_fail / trials,
                         sum(x.memory_restores for x in out) / trials, sum(x.durable_restores for x in out) / trials,
                         sum(x.double_losses for x in out) / max(1, n_fail))


@dataclass(frozen=True)
class ReplicaGroupsResult:
    ratio: float  # useful work / wall time, mean over trials
    ratio_std: float
    failures_per_trial: float
    all_out_per_trial: float  # times every group was out at once (then the job waited for the first one back)


def _replica_groups_trial(groups: int, pause_s: float, rejoin_s: float, step_s: float, mtbf_s: float,
                          total_s: float, rng: random.Random) -> tuple:
    """Failures strike uniformly chosen groups (cluster MTBF ``mtbf_s``). A live group's failure stops the others
    for the pause and the step they run again; the group is out for ``rejoin_s``, and meanwhile the live groups
    train the whole global batch at live/groups of the full rate. A failure of a group already out restarts its
    rejoin."""
    wall = done = 0.0
    back_at: List[float] = []  # when each group that is out rejoins
    failures = all_out = 0
    fail_at = rng.expovariate(1.0 / mtbf_s)
    while done < total_s:
        back_at.sort()
        live = groups - len(back_at)
        next_back = back_at[0] if back_at else math.inf
        finish_at = wall + (total_s - done) * groups / live if live else math.inf
        now = min(fail_at, next_back, finish_at)
        done = min(total_s, done + (now - wall) * live / groups)
        wall = now
        if now == finish_at:
            break
        if now == next_back:
            back_at.pop(0)
            continue
        failures += 1
        fail_at = wall + rng.expovariate(1.0 / mtbf_s)
        group = rng.randrange(groups)
        if group < len(back_at):  # one of the groups already out: its rejoin starts again
            back_at[group] = wall + rejoin_s
            continue
        if live > 1:
            wall += pause_s + step_s  # the survivors wait for the quorum, then run the lost step again
        else:
            all_out += 1
        back_at.append(wall + rejoin_s)
    return total_s / wall, failures, all_out


def simulate_replica_groups(groups: int, pause_s: float, rejoin_s: float, step_s: float, mtbf_s: float,
                            total_s: float | None = None, trials: int = 20, seed: int = 0) -> ReplicaGroupsResult:
    """parallel.fault_tolerance's recovery (docs/recovery-runbook.md): the effective training-time ratio with
    ``groups`` replica groups, the survivors' measured ``pause_s`` per failure and a group's ``rejoin_s`` (start-up
    and state transfer). Left out: the durable saves' cost, and the work lost when every group is out at once
    (counted in ``all_out_per_trial``: the job then resumes from a durable checkpoint)."""
    for name, value in (("pause_s", pause_s), ("rejoin_s", rejoin_s), ("step_s", step_s)):
        _check_seconds(name, value)
    _check_seconds("mtbf_s", mtbf_s, positive=True)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups={groups!r}: must be a whole number >= 1")
    total_s = total_s if total_s is not None else 200 * mtbf_s
    rng = random.Random(seed)
    out = [_replica_groups_trial(groups, pause_s, rejoin_s, step_s, mtbf_s, total_s, rng) for _ in range(trials)]
    ratios = [r for r, _, _ in out]
    return ReplicaGroupsResult(statistics.fmean(ratios), statistics.pstdev(ratios),
                               statistics.fmean(f for _, f, _ in out), statistics.fmean(a for _, _, a in out))


def report_replica_groups(pause_s: float, rejoin_s: float, step_s: float, devices_per_group: int,
                          device_mtbf_hours: float = DEFAULT_DEVICE_MTBF_HOURS, devices=(1000, 10000),
                          trials: int = 20) -> str:
    lines = [f"replica groups (torchft): pause {pause_s:.1f} s per failure, rejoin {rejoin_s:.1f} s, step "
             f"{step_s:.3f} s, {devices_per_group} devices per group",
             f"{'devices':>8} {'groups':>7} {'MTBF':>9} {'sim ratio':>10} {'+-':>7} {'formula':>8} {'fails/trial':>11} "
             f"{'all out':>8}"]
    for n in devices:
        m = cluster_mtbf_s(device_mtbf_hours, n)
        groups = max(1, n // devices_per_group)
        res = simulate_replica_groups(groups, pause_s, rejoin_s, step_s, m, trials=trials)
        formula = 1 - (pause_s + step_s + rejoin_s / groups) / m
        lines.append(f"{n:>8} {groups:>7} {m / 3600:>7.2f} h {res.ratio:>10.4f} {res.ratio_std:>7.4f} {formula:>8.4f} "
                     f"{res.failures_per_trial:>11.0f} {res.all_out_per_trial:>8.1f}")
    return "\n".join(lines)


def report(blocking_s: float, write_s: float, restart_s: float, step_s: float,
           device_mtbf_hours: float = DEFAULT_DEVICE_MTBF_HOURS, devices=(1000, 10000), trials: int = 20) -> str:
    lines = [f"inputs: blocking C={blocking_s:.3f} s, background write W={write_s:.3f} s, "
             f"recovery R={restart_s:.1f} s, step {step_s:.3f} s, device MTBF {device_mtbf_hours:,.0f} h",
             f"{'devices':>8} {'MTBF':>9} {'T* (s)':>9} {'T* steps':>9} {'sim ratio':>10} {'+-':>7} "
             f"{'formula':>8} {'fails/trial':>11}"]
    for n in devices:
        m = cluster_mtbf_s(device_mtbf_hours, n)
        t = max(young_daly_interval_s(m, blocking_s), write_s, step_s)
        res = simulate(t, blocking_s, restart_s, m, write_s=write_s, asynchronous=write_s > 0, trials=trials)
        formula = 1.0 - waste_fraction(t, blocking_s, m, restart_s, write_s)
        lines.append(f"{n:>8} {m / 3600:>7.2f} h {t:>9.1f} {t / step_s:>9.0f} {res.ratio:>10.4f} "
                     f"{res.ratio_std:>7.4f} {formula:>8.4f} {res.failures_per_trial:>11.0f}")
    return "\n".join(lines)


def report_two_tier(blocking_s: float, write_s: float, restart_s: float, step_s: float, durable_reload_s: float,
                    memory_stall_s: float, memory_restore_s: float, memory_interval="auto", devices_per_node: int = 8,
                    device_mtbf_hours: float = DEFAULT_DEVICE_MTBF_HOURS, devices=(1000, 10000),
                    trials: int = 20) -> str:
    """The durable tier alone (interval as in ``report``) against durable + memory tier, both simulated."""
    lines = [f"two tiers: memory snapshot stall {memory_stall_s:.3f} s, restore {memory_restore_s:.1f} s, "
             f"interval {memory_interval} steps; durable reload {durable_reload_s:.1f} s; "
             f"{devices_per_node} devices/node",
             f"{'devices':>8} {'nodes':>6} {'T dur (s)':>9} {'T mem (s)':>9} {'durable only':>12} {'two tiers':>9} "
             f"{'storage reads':>13} {'both lost':>9}"]
    for n in devices:
        m = cluster_mtbf_s(device_mtbf_hours, n)
        nodes = math.ceil(n / devices_per_node)
        t = max(young_daly_interval_s(m, blocking_s), write_s, step_s)
        durable = TwoTier(restart_s, t, blocking_s, write_s, durable_reload_s, nodes=nodes)
        steps = memory_interval
        if steps == "auto":  # the copy to the peer (about a restore's transfer) must land before the next snapshot
            steps = choose_interval_steps(step_s, memory_stall_s, memory_restore_s, m).steps
        # a durable save is written from the snapshot it rides on: it blocks only for what that stall did not cover
        two = TwoTier(restart_s, t, max(0.0, blocking_s - memory_stall_s), write_s, durable_reload_s, steps * step_s,
                      memory_stall_s, memory_restore_s, nodes)
        one, both = simulate_two_tier(durable, m, trials=trials), simulate_two_tier(two, m, trials=trials)
        lines.append(f"{n:>8} {nodes:>6} {t:>9.1f} {two.memory_interval_s:>9.1f} {one.ratio:>12.4f} {both.ratio:>9.4f} "
                     f"{both.durable_restores_per_trial / both.failures_per_trial:>13.1e} "
                     f"{both.double_loss_fraction:>9.1e}")
    return "\n".join(lines)


def memory_interval(value: str):
    """``--memory-interval``: a step count >= 1, or auto."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"--memory-interval={value!r}: use a step count >= 1 or auto")
    return steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocking-s", type=float, required=True, help="measured checkpoint blocking time C")
    p.add_argument("--write-s", type=float, default=0.0, help="background write time W (0: synchronous saving)")
    p.add_argument("--restart-s", type=float, required=True, help="measured recovery time R (MTTR)")
    p.add_argument("--step-s", type=float, required=True, help="measured step time")
    p.add_argument("--device-mtbf-hours", type=float, default=DEFAULT_DEVICE_MTBF_HOURS)
    p.add_argument("--devices", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--trials", type=int, default=20)
    two = p.add_argument_group("two tiers (given --memory-stall-s)")
    two.add_argument("--memory-stall-s", type=float, default=None, help="measured memory snapshot stall")
    two.add_argument("--memory-restore-s", type=float, default=0.0, help="memory/peer read on top of --restart-s")
    two.add_argument("--memory-interval", type=memory_interval, default="auto", help="steps, or auto (Young/Daly)")
    two.add_argument("--durable-reload-s", type=float, default=0.0,
                     help="storage read on top of --restart-s (0: the measured MTTR includes it)")
    two.add_argument("--devices-per-node", type=int, default=8)
    ft = p.add_argument_group("replica groups under torchft (given --ft-pause-s; parallel.fault_tolerance)")
    ft.add_argument("--ft-pause-s", type=float, default=None, help="measured survivors' pause per failure")
    ft.add_argument("--ft-rejoin-s", type=float, default=0.0, help="measured rejoin: start-up and state transfer")
    ft.add_argument("--devices-per-group", type=int, default=8)
    a = p.parse_args(argv)
    print(report(a.blocking_s, a.write_s, a.restart_s, a.step_s, a.device_mtbf_hours, a.devices, a.trials))
    if a.ft_pause_s is not None:
        if a.devices_per_group < 1:
            p.error(f"--devices-per-group={a.devices_per_group}: must be >= 1")
        try:
            print(report_replica_groups(a.ft_pause_s, a.ft_rejoin_s, a.step_s, a.devices_per_group,
                                        a.device_mtbf_hours, a.devices, a.trials))
        except ValueError as exc:
            p.error(str(exc))
    if a.memory_stall_s is not None:
        if a.devices_per_node < 1:
            p.error(f"--devices-per-node={a.devices_per_node}: must be >= 1")
        try:
            print(report_two_tier(a.blocking_s, a.write_s, a.restart_s, a.step_s, a.durable_reload_s, a.memory_stall_s,
                                  a.memory_restore_s, a.memory_interval, a.devices_per_node, a.device_mtbf_hours,
                                  a.devices, a.trials))
        except ValueError as exc:
            p.error(str(exc))


if __name__ == "__main__":
    main()
