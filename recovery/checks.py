"""The recovery section checked at start-up (torch-free; trainer/checks.py gathers it): watchdog
timeouts, stragglers, preemption, fallback, failure model, injected faults, guards."""

from __future__ import annotations

import math
import signal
from typing import Optional

from configs.checks import Problems
from configs.constants import GUARD_ACTIONS, WATCHDOG_PHASES
from recovery.faults import fault_problems


def config_problems(cfg, problems: Problems) -> None:
    r = cfg.recovery
    unknown = sorted(set(r.timeouts) - set(WATCHDOG_PHASES))
    if unknown:
        problems.append(f"recovery.timeouts has unknown phases {unknown}: the phases are {list(WATCHDOG_PHASES)}")
    for phase, seconds in r.timeouts.items():
        problems.positive(f"recovery.timeouts.{phase}", seconds)
    problems.positive("recovery.checkpoint_write_timeout_s", r.checkpoint_write_timeout_s)
    problems.at_least("recovery.straggler_interval", r.straggler_interval, 0, "0 disables the report")
    if not r.straggler_factor > 1:
        problems.append(f"recovery.straggler_factor={r.straggler_factor} must be > 1")
    for name in r.preemption_signals:
        if not (str(name).startswith("SIG") and hasattr(signal, str(name))):
            problems.append(f"recovery.preemption_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
    problems.positive("recovery.preemption_grace_s", r.preemption_grace_s)
    problems.positive("recovery.probe_rtol_reshard", r.probe_rtol_reshard)
    problems.at_least("recovery.max_fallbacks", r.max_fallbacks, 0)
    problems.at_least("recovery.read_retries", r.read_retries, 0, "0 skips an unreadable checkpoint at once")
    problems.positive("recovery.read_retry_backoff_s", r.read_retry_backoff_s)
    too_long = _read_retries_problem(r.read_retries, r.read_retry_backoff_s, cfg.parallel)
    if too_long:
        problems.append(too_long)
    problems.positive("recovery.device_mtbf_hours", r.device_mtbf_hours)
    problems.at_least("recovery.devices", r.devices, 0, "0 uses the world size")
    for i, fault in enumerate(r.faults):
        problems += fault_problems(fault, f"recovery.faults[{i}]")
    g = r.guards
    problems.choice("recovery.guards.action", g.action, GUARD_ACTIONS)
    problems.at_least("recovery.guards.warmup_steps", g.warmup_steps, 0)
    if not g.grad_norm_multiple > 1:
        problems.append(f"recovery.guards.grad_norm_multiple={g.grad_norm_multiple} must be > 1")
    for key in ("loss_window", "shadow_window"):
        problems.at_least(f"recovery.guards.{key}", g[key], 3, "a median needs a few values")
    for key in ("shadow_interval", "replica_interval", "rollback_min_age_steps"):
        problems.at_least(f"recovery.guards.{key}", g[key], 0)
    for key in ("max_consecutive_skips", "max_rollbacks"):
        problems.at_least(f"recovery.guards.{key}", g[key], 1)


def _read_retries_problem(retries, backoff_s, parallel) -> Optional[str]:
    """Rank 0 reads the shared files for everyone, again after backoff_s, 2 x backoff_s, ... while every
    other rank waits in one collective (checkpoint/durable/reads.py). Its waits must end before that
    collective times out, or the ranks fail with the collective's timeout instead of the storage's error.
    A rollback reads mid-run, under the timeout after the first step; so the smaller timeout bounds it."""
    try:
        retries, backoff_s = int(retries), float(backoff_s)
        limit = min(float(parallel.collective_timeout_s), float(parallel.collective_timeout_after_first_step_s))
    except (TypeError, ValueError, OverflowError):
        return None  # refused by the values' own checks
    if not (retries > 0 and 0 < backoff_s < math.inf and 0 < limit < math.inf):
        return None  # (NaN fails every comparison)
    # the waits, backoff_s x (2**retries - 1), reach the limit from this many retries on (no 2**retries)
    reaching = max(1, math.ceil(math.log2(limit / backoff_s + 1)))
    if retries < reaching:
        return None
    waits = backoff_s * (2.0 ** reaching - 1)
    seconds = f"{waits:,.0f} s" if waits < 1e9 else f"{waits:.3g} s"
    said = seconds if retries == reaching else f"at least {seconds} (from {reaching} retries on)"
    return (f"recovery.read_retries={retries} with recovery.read_retry_backoff_s={backoff_s:g} lets rank 0 wait "
            f"{said} in all before its last read, while every other rank waits in one collective that "
            f"fails after {limit:g} s (parallel.collective_timeout_s={float(parallel.collective_timeout_s):g}, "
            f"collective_timeout_after_first_step_s={float(parallel.collective_timeout_after_first_step_s):g}): "
            "lower read_retries or read_retry_backoff_s, or raise the collective timeouts")
