"""The recovery section (``recovery.*``): the watchdog, preemption, verified resume and its fallback, the
failure model of checkpoint.interval=auto, injected faults and the guards' sub-section (torch-free)."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from configs.keys import MAX_SECONDS, NON_NEGATIVE, POSITIVE, SECONDS, Bound, key, section
from recovery.guards.config import GuardsConfig  # unit: guards

# The phases the training loop reports to the watchdog, and their default timeouts in seconds; a phase absent
# from recovery.timeouts uses the "step" timeout.
DEFAULT_TIMEOUTS = {
    "first_step": 600.0,  # compilation, allocator warm-up, first collectives
    "step": 120.0,
    "data_wait": 120.0,
    "checkpoint_snapshot": 300.0,
    "checkpoint_load": 600.0,
    "eval": 600.0,
    "shutdown": 300.0,
}
WATCHDOG_PHASES = tuple(DEFAULT_TIMEOUTS)

# What can be injected (recovery/faults.py), where, and how a checkpoint is damaged.
FAULT_KINDS = ("sigkill", "hang", "exception", "nan_loss", "corrupt", "bitflip_param", "bitflip_grad", "disk_full",
               "node_loss", "slow", "read_error")
SAVE_PHASES = ("checkpoint_snapshot", "checkpoint_write", "checkpoint_commit", "checkpoint_committed")
FAULT_PHASES = ("step", "data_wait", "gradients", "eval") + SAVE_PHASES + (
    "checkpoint_retention", "checkpoint_load", "checkpoint_read", "manifest_read", "memory_snapshot", "memory_replica",
    "memory_commit", "memory_replica_write")
READ_ERROR_PHASES = ("checkpoint_read", "manifest_read")  # a read_error fails a data file's read or a manifest's
CORRUPTIONS = ("truncate", "flip_byte", "delete_file", "delete_manifest")
# where disk_full raises ENOSPC
DISK_FULL_PHASES = ("checkpoint_write", "checkpoint_commit", "memory_commit", "memory_replica_write")


@dataclass
class FaultConfig:
    """One injected fault (recovery/faults.py): fires once per run directory (``slow``: every match)."""

    kind: str = key("sigkill", "what happens", choices=FAULT_KINDS)
    phase: str = key("step", "where: a watchdog phase or a checkpoint phase", choices=FAULT_PHASES)
    step: int = key(-1, "1-based step (for checkpoint phases: the checkpoint's step); -1: any", Bound(1, also=(-1,)))
    rank: int = key(0, "the rank it fires on; -1: every rank", Bound(0, also=(-1,)))
    corruption: str = key("flip_byte", "corrupt: how the committed checkpoint is damaged", choices=CORRUPTIONS)
    hang_s: float = key(3600.0, "hang: how long", SECONDS)
    bit: int = key(30, "bitflip_param | bitflip_grad: which bit of the fp32 word to flip",
                   Bound(0, 32, open_high=True, why="an fp32 word"))
    param: str = key("", "bitflip_*: the parameter's name; empty: block 0's first matrix")
    delay_s: float = key(0.05, "slow: seconds added each time it matches (with step=-1: every step, every save)",
                         Bound(0, MAX_SECONDS))
    times: int = key(1, "how many matches fire it (its markers count them); -1: every match (slow always)",
                     Bound(1, also=(-1,)))
    skip: int = key(0, "pass over the first this many matches (a step replayed after a rollback is the next)",
                    NON_NEGATIVE)

    def check(self, name: str) -> List[str]:
        """Which phases a kind can fire at; ``name`` is the entry (``recovery.faults[2]``)."""
        kind, phase, out = self.kind, self.phase, []
        if kind == "corrupt" and phase != "checkpoint_committed":
            out.append(f"{name}: a corrupt fault damages a committed checkpoint: use phase=checkpoint_committed "
                       f"(not {phase!r})")
        if kind == "bitflip_param" and phase not in ("step", "gradients"):
            out.append(f"{name}: bitflip_param flips a weight before the forward pass (phase=step) or after "
                       f"backward, where this step's gradients no longer see it (phase=gradients), not at {phase!r}")
        if kind == "bitflip_grad" and phase != "gradients":
            out.append(f"{name}: bitflip_grad flips a gradient after backward: use phase=gradients (not {phase!r})")
        if kind == "node_loss" and phase not in ("step", "data_wait"):
            out.append(f"{name}: node_loss takes the node down between steps: use phase step or data_wait (not "
                       f"{phase!r})")
        if kind == "read_error" and phase not in READ_ERROR_PHASES:
            out.append(f"{name}: read_error fails a read of a checkpoint's data file (phase=checkpoint_read) or of "
                       f"its manifest (phase=manifest_read), not at {phase!r}")
        if kind == "slow" and not self.delay_s > 0:
            out.append(f"{name}.delay_s={self.delay_s} must be > 0 (the seconds this rank is slower at {phase})")
        if kind == "disk_full" and phase not in DISK_FULL_PHASES:
            out.append(f"{name}: disk_full fails a checkpoint write: use phase one of {list(DISK_FULL_PHASES)} "
                       f"(not {phase!r})")
        return out


@dataclass
class RecoveryConfig:
    halt_on_nonfinite_loss: bool = key(True, "stop on a NaN or infinite loss (unless the guards skipped the step)")
    watchdog: bool = key(True, "a rank without a heartbeat for its phase's timeout dumps its stacks and aborts, so "
                         "the launcher restarts the group (recovery/watchdog.py)")
    timeouts: Dict[str, float] = key(DEFAULT_TIMEOUTS, "seconds per phase", SECONDS)
    checkpoint_write_timeout_s: float = key(900.0, "a background checkpoint write stuck longer aborts the rank",
                                            SECONDS)
    straggler_interval: int = key(50, "steps between straggler reports; 0 disables", NON_NEGATIVE)
    straggler_factor: float = key(1.5, "a rank slower than factor x the median is named", Bound(1, open_low=True))
    preemption_signals: List[str] = key(["SIGTERM", "SIGUSR1"], "these signals save at the next step boundary and "
                                        "exit (recovery/runtime.py: Preemption)")
    preemption_grace_s: float = key(120.0, "the time a preemption notice leaves", SECONDS)
    verify: bool = key(True, "post-load verification (recovery/verify.py): probe loss, LR and step; fallback")
    probe_rtol_reshard: float = key(1e-4, "probe loss tolerance across layouts, devices or kernels (else bitwise)",
                                    POSITIVE)
    max_fallbacks: int = key(3, "older checkpoints tried after a failed verification, then stop", NON_NEGATIVE)
    read_retries: int = key(3, "a checkpoint the storage failed to deliver (EIO, ESTALE) is read again ...",
                            NON_NEGATIVE)
    read_retry_backoff_s: float = key(2.0, "... after 2, 4, 8 s; then skipped for this attempt, never marked BAD",
                                      SECONDS)
    allow_global_batch_change: bool = key(False, "resume with a global batch other than the checkpoint's")
    device_mtbf_hours: float = key(50000.0, "one device's mean time between failures, for checkpoint.interval=auto",
                                   POSITIVE)
    devices: int = key(0, "devices in the job for the MTBF; 0: the world size", NON_NEGATIVE)
    faults: List[FaultConfig] = field(default_factory=list, metadata={"meaning": "fault injection; empty: off"})
    guards: GuardsConfig = section(GuardsConfig, "silent-corruption and loss-spike guards")  # unit: guards

    def check(self, collective_timeouts_s: tuple) -> List[str]:
        """``collective_timeouts_s``: parallel's, which bound rank 0's read retries."""
        out = []
        unknown = sorted(set(self.timeouts) - set(WATCHDOG_PHASES))
        if unknown:
            out.append(f"recovery.timeouts has unknown phases {unknown}: the phases are {list(WATCHDOG_PHASES)}")
        for name in self.preemption_signals:
            if not (str(name).startswith("SIG") and hasattr(signal, str(name))):
                out.append(f"recovery.preemption_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
        too_long = read_retries_problem(self.read_retries, self.read_retry_backoff_s, *collective_timeouts_s)
        out += [too_long] if too_long else []
        for i, fault in enumerate(self.faults):
            out += fault.check(f"recovery.faults[{i}]")
        return out


def read_retries_problem(retries, backoff_s, timeout_s, after_first_step_s) -> Optional[str]:
    """Rank 0 reads the shared files for everyone, again after backoff_s, 2 x backoff_s, ... while every
    other rank waits in one collective (checkpoint/durable/reads.py). Its waits must end before that
    collective times out, or the ranks fail with the collective's timeout instead of the storage's error.
    A rollback reads mid-run, under the timeout after the first step; so the smaller timeout bounds it."""
    try:
        retries, backoff_s = int(retries), float(backoff_s)
        limit = min(float(timeout_s), float(after_first_step_s))
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
            f"fails after {limit:g} s (parallel.collective_timeout_s={float(timeout_s):g}, "
            f"collective_timeout_after_first_step_s={float(after_first_step_s):g}): "
            "lower read_retries or read_retry_backoff_s, or raise the collective timeouts")
