"""Heartbeat watchdog: a hung rank is detected once its phase's timeout passes (recovery.timeouts:
120 s for a step by default, 600 s for the first) and its process aborted.

A stuck collective on a healthy-looking rank costs clusters the most time: NCCL's own timeout is
10-30 minutes. The loop calls ``beat(phase, step)`` at every phase boundary; a daemon thread compares
the time since the last beat with the timeout of the *current* phase (a first step or a load may take
minutes, a step should not). On expiry it writes every thread's stack and a JSON record into
``<run_dir>/watchdog/`` and aborts, so the launcher restarts the group, which resumes.

A background checkpoint write has its own timer (``write_started``/``write_done``): training keeps
beating while it runs, so a write stuck on a dead file system would go unnoticed until the next save
waited for it forever. A hang that holds the GIL (a C extension spinning) stops the thread too: then
``faulthandler.dump_traceback_later``, re-armed at every beat at the timeout plus ``hard_margin_s``,
dumps the stacks and exits from C.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import resource
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional

from recovery.config import DEFAULT_TIMEOUTS

log = logging.getLogger("trainer")


@dataclass
class Expiry:
    """What the watchdog found when it fired: the content of the JSON record."""

    kind: str  # "heartbeat" (the loop stopped beating) or "checkpoint_write" (a background write is stuck)
    rank: int
    host: str
    pid: int
    phase: str
    step: int
    seconds_since_beat: float
    timeout_s: float
    detected_at: float  # time.time()
    last_beat_at: float  # time.time() of the last beat (or of the write start)
    extra: Dict[str, object] = field(default_factory=dict)


def _abort(expiry: Expiry) -> None:
    """SIGABRT: the launcher sees a failed worker and restarts the group. Without a core dump, whatever
    ``ulimit -c`` allows: the stacks are on disk already, and a core is the process's whole mapping (a
    GPU's memory included), written for minutes while the launcher waits for the process to end."""
    faulthandler.disable()  # the stacks are already on disk; do not dump them again to stderr
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.abort()


class Watchdog:
    """Phase-aware heartbeat watchdog for one rank.

    ``on_expire`` replaces the abort (tests use it to observe a firing without dying).
    """

    def __init__(self, run_dir: Path | str, rank: int = 0, timeouts: Optional[Dict[str, float]] = None,
                 write_timeout_s: float = 900.0, hard_margin_s: float = 30.0,
                 on_expire: Optional[Callable[[Expiry], None]] = None):
        self.dir = Path(run_dir) / "watchdog"
        self.rank = rank
        self.timeouts = dict(DEFAULT_TIMEOUTS)
        self.timeouts.update(timeouts or {})
        self.write_timeout_s = write_timeout_s
        # Poll often enough that detection lands well inside timeout + 1 s even when the machine is
        # loaded; the check itself is a few attribute reads.
        self.poll_s = max(0.05, min(0.5, min(list(self.timeouts.values()) + [write_timeout_s]) / 10))
        self.hard_margin_s = hard_margin_s
        self.on_expire = on_expire or _abort
        self._lock = threading.Lock()
        self._phase = "first_step"
        self._step = 0
        self._beat_mono = time.monotonic()
        self._beat_wall = time.time()
        self._write: Optional[tuple] = None  # (step, monotonic start, wall start, is_done)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- called by the training loop ------------------------------------------------------
    def start(self) -> "Watchdog":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.beat("first_step", self._step)
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, phase: str, step: int) -> None:
        """Record progress: the loop entered ``phase`` at ``step``."""
        with self._lock:
            self._phase, self._step = phase, step
            self._beat_mono, self._beat_wall = time.monotonic(), time.time()
        if self._thread is not None and self.hard_margin_s > 0:
            faulthandler.dump_traceback_later(self.timeout_of(phase) + self.hard_margin_s, exit=True)

    def write_started(self, step: int, is_done: Optional[Callable[[], bool]] = None) -> None:
        """A background checkpoint write for ``step`` began; it has ``write_timeout_s``. ``is_done``
        (thread-safe, e.g. the write's ``Future.done``) lets the watchdog see it finish even while
        the training thread, which would call ``write_done``, is itself stuck."""
        with self._lock:
            self._write = (step, time.monotonic(), time.time(), is_done)

    def write_done(self) -> None:
        with self._lock:
            self._write = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()

    def set_timeout(self, phase: str, seconds: float) -> None:
        """Change ``phase``'s timeout from now on (preemption: the grace period left bounds the save)."""
        with self._lock:
            self.timeouts[phase] = float(seconds)

    def timeout_of(self, phase: str) -> float:
        return self.timeouts.get(phase, self.timeouts["step"])

    # -- the watchdog thread --------------------------------------------------------------
    def check(self) -> Optional[Expiry]:
        """The expiry due now, or None."""
        now = time.monotonic()
        with self._lock:
            phase, step, beat_mono, beat_wall, write = (self._phase, self._step, self._beat_mono,
                                                        self._beat_wall, self._write)
        host, pid = socket.gethostname(), os.getpid()
        since = now - beat_mono
        timeout = self.timeout_of(phase)
        if since > timeout:
            return Expiry("heartbeat", self.rank, host, pid, phase, step, since, timeout, time.time(), beat_wall)
        if write is not None and now - write[1] > self.write_timeout_s and not (write[3] and write[3]()):
            return Expiry("checkpoint_write", self.rank, host, pid, "checkpoint_write", write[0], now - write[1],
                          self.write_timeout_s, time.time(), write[2], {"training_phase": phase, "training_step": step})
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            expiry = self.check()
            if expiry is not None:
                self._fire(expiry)
                return

    def _fire(self, expiry: Expiry) -> None:
        stem = f"rank{self.rank}-pid{expiry.pid}-{int(expiry.detected_at)}"
        try:
            with open(self.dir / f"{stem}-stacks.txt", "w") as f:
                f.write(f"watchdog: {expiry.kind} expired in phase {expiry.phase} at step {expiry.step} "
                        f"({expiry.seconds_since_beat:.1f} s > {expiry.timeout_s:.1f} s)\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            tmp = self.dir / f".{stem}.json.tmp"
            tmp.write_text(json.dumps(asdict(expiry), indent=2, sort_keys=True))
            os.replace(tmp, self.dir / f"{stem}.json")
        finally:
            log.error("watchdog: rank %d %s timeout in phase %s at step %d: %.1f s since the last beat "
                      "(limit %.1f s); stacks and diagnostics in %s; aborting so the launcher restarts the group",
                      self.rank, expiry.kind, expiry.phase, expiry.step, expiry.seconds_since_beat,
                      expiry.timeout_s, self.dir)
            faulthandler.cancel_dump_traceback_later()
            self.on_expire(expiry)


def read_records(run_dir: Path | str) -> list:
    """Every watchdog diagnostics record of a run, oldest first."""
    d = Path(run_dir) / "watchdog"
    records = [json.loads(p.read_text()) for p in d.glob("*.json")] if d.exists() else []
    return sorted(records, key=lambda r: r["detected_at"])
