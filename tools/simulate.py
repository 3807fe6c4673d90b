"""Failure simulator: what fraction of wall time a job spends on new training.

Monte Carlo over a timeline with exponentially distributed failures (cluster MTBF M):
compute for T seconds, checkpoint (blocking C; with async saving the write then commits W
seconds later while training continues); a failure loses everything after the last
*committed* checkpoint and costs the recovery time R (detection, restart, load, first
step: the MTTR that scripts/bench_recovery.py measures). The effective training time
ratio is useful work / wall time. It checks the first-order formula in recovery/interval.py
and includes what the formula leaves out (failures during saves, lost in-flight writes).

    python -m recovery.simulate --blocking-s 0.05 --write-s 0.4 --restart-s 12 --step-s 0.1
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass
from typing import List

from recovery.interval import DEFAULT_DEVICE_MTBF_HOURS, cluster_mtbf_s, waste_fraction, young_daly_interval_s


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocking-s", type=float, required=True, help="measured checkpoint blocking time C")
    p.add_argument("--write-s", type=float, default=0.0, help="background write time W (0: synchronous saving)")
    p.add_argument("--restart-s", type=float, required=True, help="measured recovery time R (MTTR)")
    p.add_argument("--step-s", type=float, required=True, help="measured step time")
    p.add_argument("--device-mtbf-hours", type=float, default=DEFAULT_DEVICE_MTBF_HOURS)
    p.add_argument("--devices", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--trials", type=int, default=20)
    a = p.parse_args(argv)
    print(report(a.blocking_s, a.write_s, a.restart_s, a.step_s, a.device_mtbf_hours, a.devices, a.trials))


if __name__ == "__main__":
    main()
