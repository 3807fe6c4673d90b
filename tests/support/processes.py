"""Long-running jobs that tests signal or kill halfway: start, wait for a moment, find the workers."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO, Sequence

from rehearsal.processes import children, kill_tree
from support.launch import ROOT, subprocess_env, warm_enabled

__all__ = ["alive", "children", "start", "stop", "wait_for_faults"]


def start(cmd: Sequence[str], log: IO, extra_env: dict | None = None, warm: bool = False, **kwargs):
    """``cmd`` in the repository root with the test environment, stdout and stderr into ``log``.
    ``warm=True`` forks it from the warm parent (support/warm.py; a ``WarmProcess``, used as a Popen)."""
    if warm and warm_enabled() and not kwargs:
        from support import warm as warm_parent

        return warm_parent.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(extra_env))
    return subprocess.Popen(list(cmd), cwd=ROOT, env=subprocess_env(extra_env), stdout=log,
                            stderr=subprocess.STDOUT, **kwargs)


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_faults(run_dir: Path, count: int, job: subprocess.Popen, log_path: Path, timeout: float = 400) -> None:
    """Until ``count`` injected faults have fired in ``run_dir`` (e.g. every rank is in a stall)."""
    deadline = time.monotonic() + timeout
    while len(list((Path(run_dir) / "faults").glob("fired-*"))) < count:
        if job.poll() is not None:
            raise AssertionError(f"the job exited ({job.returncode}) early:\n{Path(log_path).read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count} faults fired in {timeout} s:\n{Path(log_path).read_text()[-6000:]}")
        time.sleep(0.05)


def stop(job: subprocess.Popen) -> None:
    """Kill ``job`` and every process below it (cleanup after a failed test)."""
    if job.poll() is None:
        kill_tree(job.pid)
        job.wait()
