"""Preemption: on SIGTERM/SIGUSR1 every rank saves at the same step boundary, then exits.

Schedulers announce preemption with a signal (SLURM: SIGTERM or ``--signal=USR1@90``;
Kubernetes: SIGTERM and a grace period). The handler only sets a flag: saving from inside
a signal handler would interleave with a half-done step. Ranks may receive the signal at
different moments, so at each step boundary they agree with an all_reduce MAX of the
flag: if any rank was signalled, all save at the same step, wait for the commit and exit
cleanly. The grace period bounds the whole save; a save that cannot commit in time is
abandoned (the previous committed checkpoint stays valid, contract 3).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("trainer")


class Preemption:
    def __init__(self, signals: Iterable[str] = ("SIGTERM", "SIGUSR1"), grace_s: float = 120.0,
                 group: Optional[dist.ProcessGroup] = None):
        self.signals = [getattr(signal, s) if isinstance(s, str) else s for s in signals]
        self.grace_s = grace_s
        self.group = group
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

    def should_stop(self) -> bool:
        """Collective at a step boundary: True on every rank if any rank was signalled."""
        flag = 1 if self.requested_at is not None else 0
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            t = torch.tensor([flag], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = int(t.item())
        if flag and self.requested_at is None:
            self.requested_at = time.monotonic()  # another rank was signalled; start our clock too
            self.signal_name = "peer"
        return bool(flag)

    def seconds_left(self) -> float:
        """Of the grace period, from the first signal seen on this rank."""
        if self.requested_at is None:
            return self.grace_s
        return self.grace_s - (time.monotonic() - self.requested_at)
