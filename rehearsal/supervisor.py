"""A restart supervisor for rehearsals: torchrun's ``--max-restarts`` for one process, fast.

Rehearsing recovery means killing training dozens of times. Each torchrun or python start
costs seconds here (``import torch`` alone is ~2 s), which would make a 20-kill suite take
many minutes. The supervisor imports everything once, composes the Hydra config once, and
runs each attempt (``trainer.run.run``) in a child *forked* from that warm parent: a real process, killed by a
real SIGKILL, that writes real files; the restart costs milliseconds. After each death it
records which committed checkpoint was newest, so callers can check that the next attempt
resumed from exactly that one.

The parent must not have run torch ops (no OpenMP pool exists yet), so forking is safe.
Only for single-process runs; multi-rank rehearsals go through torchrun.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from checkpoint.durable.discovery import latest_committed
from trainer.config import register
from trainer.preflight import validate_config

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Attempt:
    returncode: int  # as subprocess reports it: -9 for SIGKILL
    pid: int
    seconds: float
    newest_committed_after: Optional[str]  # checkpoint_id newest committed (not bad) when it ended


@dataclass
class Supervised:
    attempts: List[Attempt] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].returncode == 0

    @property
    def kills(self) -> int:
        return sum(a.returncode == -signal.SIGKILL for a in self.attempts)


def compose(overrides: Sequence[str]):
    """The Hydra config train.py would get for ``overrides``, validated."""
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    validate_config(cfg)
    return cfg


def warm_imports() -> None:
    """Import, in the parent, what a training run imports (trainer.run imports at its top), plus
    what torch imports lazily on first use, so every forked attempt starts warm."""
    import importlib

    importlib.import_module("trainer.run")
    importlib.import_module("torch.distributed.checkpoint")
    importlib.import_module("torch._dynamo")  # init on the meta device imports it lazily (seconds)


def _newest_committed(ckpt_dir: Path) -> Optional[str]:
    newest = latest_committed(ckpt_dir)
    return newest.checkpoint_id if newest else None


def _child(cfg, overrides: Sequence[str], log_path: Path) -> None:
    """Run training in this (forked) process and never return to the caller's code."""
    code = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        from trainer.run import run

        run(cfg, list(overrides))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def supervise(overrides: Sequence[str], max_restarts: int, log_path: Path, timeout_s: float = 600.0,
              cfg=None) -> Supervised:
    """Run ``trainer.run.run`` with ``overrides`` until it exits 0 or ``max_restarts`` is used up."""
    warm_imports()

    cfg = cfg if cfg is not None else compose(overrides)
    ckpt_dir = Path(cfg.checkpoint.dir)
    out = Supervised()
    for _ in range(max_restarts + 1):
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(cfg, overrides, log_path)
        deadline = t0 + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"attempt {len(out.attempts) + 1} ran past {timeout_s} s; log: {log_path}")
            time.sleep(0.01)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.attempts.append(Attempt(rc, pid, time.monotonic() - t0, _newest_committed(ckpt_dir)))
        if rc == 0:
            break
    return out


def main(argv=None) -> None:
    """Run a batch of supervised runs from one warm parent: spec.json is a list of
    {"name", "overrides", "max_restarts"}; results.json gets each run's attempts."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("spec", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    results = {}
    for run in json.loads(a.spec.read_text()):
        log_path = a.out.parent / f"{run['name']}.log"
        sup = supervise(run["overrides"], run.get("max_restarts", 0), log_path, run.get("timeout_s", 600.0))
        results[run["name"]] = {"attempts": [x.__dict__ for x in sup.attempts], "log": str(log_path)}
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
