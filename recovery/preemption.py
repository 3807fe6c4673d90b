"""Preemption: on SIGTERM/SIGUSR1 every rank saves at the same step boundary, then exits.

Schedulers announce preemption with a signal (SLURM: SIGTERM or ``--signal=USR1@90``;
Kubernetes: SIGTERM and a grace period). The handler only sets a flag: saving from inside
a signal handler would interleave with a half-done step. Ranks may receive the signal at
different moments, so at each step boundary they agree with an all_reduce MAX of the
flag: if any rank was signalled, all save at the same step, wait for the commit and exit
cleanly. The grace period bounds the whole save; a save that cannot commit in time is
abandoned (the previous committed checkpoint stays valid, contract 3). The same collective
carries the other reasons every rank must stop at one step (``agree``: a failed save).

Under torchrun the signal goes to the agent, not to the workers: docs/recovery-runbook.md
says which signal reaches which process, and scripts/torchrun_preemptible.py is the agent that
forwards SIGTERM and SIGUSR1 to the workers instead of tearing them down.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable, Optional, Tuple

import torch

from parallel import collectives


class Preemption:
    def __init__(self, signals: Iterable[str] = ("SIGTERM", "SIGUSR1"), grace_s: float = 120.0):
        self.signals = [getattr(signal, s) for s in signals]
        self.grace_s = grace_s
        self.requested_at: Optional[float] = None  # monotonic time of the first signal on this rank
        self.signal_name: Optional[str] = None
        self._previous = {}

    def install(self) -> "Preemption":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal_name = signal.Signals(signum).name

    def agree(self, *flags: bool) -> Tuple[bool, ...]:
        """Collective at a step boundary, one all_reduce MAX: (any rank signalled, then each of
        ``flags`` true on any rank)."""
        values = [1 if self.requested_at is not None else 0] + [1 if f else 0 for f in flags]
        values = [int(v) for v in collectives.agree_max(values, dtype=torch.int32)]
        if values[0] and self.requested_at is None:
            self.requested_at = time.monotonic()  # another rank was signalled; start our clock too
            self.signal_name = "peer"
        return tuple(bool(v) for v in values)

    def seconds_left(self) -> float:
        """Of the grace period, from the first signal seen on this rank."""
        if self.requested_at is None:
            return self.grace_s
        return self.grace_s - (time.monotonic() - self.requested_at)


def torchrun_grace_problem(grace_s: float, environ=os.environ) -> Optional[str]:
    """Under torchrun: the agent SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by
    default) after it got SIGTERM; a shorter time than the grace period cuts preemption saves off.
    The workers inherit the agent's environment, so they can see it (not ``--shutdown-timeout``)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    shutdown = float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    if shutdown >= grace_s:
        return None
    return (f"torchrun kills its workers {shutdown:.0f} s after it gets SIGTERM (TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
            f"{'' if 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT' in environ else ' unset: the default'}), less than "
            f"recovery.preemption_grace_s={grace_s:g}: a preemption save may be cut off. Launch with "
            f"scripts/launch_single_node.sh or scripts/launch_multi_node.sh, or export "
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={int(grace_s) + 30} (docs/recovery-runbook.md)")
