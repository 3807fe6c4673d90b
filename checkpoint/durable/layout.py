"""Names in checkpoint.dir. One checkpoint is one folder:

    step_00000100/       a save of step 100; committed once its manifest.json exists (written last,
                         only if absent: checkpoint/durable/commit.py). Without one: a save in
                         progress, or one a crash interrupted: never loaded, cleaned at start-up
    step_00000100.r1/    a later save of step 100 (after a rollback, or a resume from an older step):
                         a save never writes into, moves or copies a folder that exists
    latest               text: the checkpoint_id of the newest commit (for people and tools)
    attempts/            the attempt lease (checkpoint/durable/lease.py)
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from checkpoint.storage import Loc, location

PREFIX = "step_"
REVISION = ".r"  # + n: the n-th later save of the same step
MANIFEST = "manifest.json"
LATEST = "latest"
BAD_MARKER = "BAD"  # inside a committed checkpoint: recovery found it unusable (text: why)
SUPERSEDED_MARKER = "SUPERSEDED"  # inside a committed checkpoint: of a trajectory a rollback abandoned (why)
ACKS = "acks"  # inside a checkpoint being saved: one file per rank that finished writing

_NAME = re.compile(r"^step_(\d{8,})(?:\.r(\d+))?$")


def checkpoint_id(step: int, revision: int = 0) -> str:
    return f"{PREFIX}{step:08d}" + (f"{REVISION}{revision}" if revision else "")


def parse(name: str) -> Optional[Tuple[int, int]]:
    """(step, revision) of a checkpoint folder name; None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def checkpoint_dir(root, step: int, revision: int = 0) -> Loc:
    return location(root) / checkpoint_id(step, revision)


def fresh_dir(root, step: int) -> Loc:
    """Where a new save of ``step`` goes: step_N, or the next revision when a folder of step N exists
    (committed, damaged or interrupted): what is there is never overwritten."""
    first = checkpoint_dir(root, step)
    if not first.is_dir():
        return first
    taken = [p[1] for e in location(root).entries() if (p := parse(e.name)) is not None and p[0] == step]
    return checkpoint_dir(root, step, max(taken, default=0) + 1)
