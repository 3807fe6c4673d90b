"""Run by tests/integration/test_s3_protocol.py: one S3 save by the real CheckpointManager, SIGKILLed at a named point.

  python tests/support/workers/s3_save_worker.py CONFIG.yaml STEP TRAJECTORY KILL_POINT

CONFIG.yaml is a resolved config (checkpoint.dir=s3://...; the endpoint comes from the environment);
the state saved is support/s3.py's ``tiny_state(STEP, TRAJECTORY)``. KILL_POINT is a key of
support/s3.py's KILL_POINTS: the process SIGKILLs itself there, so exit code -9 says it got there.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the support package


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_call(method: str, key_suffix: str, nth: int) -> None:
    """Wrap one method of this process's S3 client: SIGKILL right after its ``nth`` call on a key
    ending with ``key_suffix`` returned (from whichever thread made it)."""
    from checkpoint.storage.s3.store import client

    c = client()
    original, seen = getattr(c, method), [0]

    def wrapped(**kwargs):
        out = original(**kwargs)
        if str(kwargs.get("Key", "")).endswith(key_suffix):
            seen[0] += 1
            if seen[0] == nth:
                die()
        return out

    setattr(c, method, wrapped)


def main() -> None:
    from omegaconf import OmegaConf

    from support.s3 import KILL_POINTS, manager, tiny_state

    config, step, trajectory, point = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    how = KILL_POINTS[point]
    hook = None
    if how[0] == "call":
        die_after_call(*how[1:])
    else:
        def hook(phase, at_step, path=None):
            if phase == how[1]:
                die()
    with manager(OmegaConf.load(config), tiny_state(step, trajectory), fault_hook=hook) as mgr:
        mgr.save(step, 1.0)


if __name__ == "__main__":
    main()
