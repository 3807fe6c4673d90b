"""Names on disk. One checkpoint is one directory under ``checkpoint.dir``:

    step_00000100/               committed: manifest.json present, renamed into place atomically
    step_00000200.uncommitted/   being written, or left by a crash: never loaded, cleaned at start-up
    step_00000050.deleting/      being removed by retention: never loaded, cleaned at start-up
    step_00000300.replaced-<ns>/ an older save of the same step, moved aside (kept for people)
    latest                       text: the checkpoint_id of the newest commit (for people and tools)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from checkpoint.durable.location import location, on_object_store

PREFIX = "step_"
UNCOMMITTED = ".uncommitted"
DELETING = ".deleting"
MANIFEST = "manifest.json"
LATEST = "latest"
BAD_MARKER = "BAD"  # inside a committed checkpoint: recovery found it unusable (text: why)
SUPERSEDED_MARKER = "SUPERSEDED"  # inside a committed checkpoint: of a trajectory a rollback abandoned (why)
REPLACED = ".replaced-"  # + a nanosecond time: an older save of the same step, moved aside
ACKS = "acks"  # inside an uncommitted checkpoint: one file per rank that finished writing

_NAME = re.compile(r"^step_(\d{8,})(\..+)?$")


def checkpoint_id(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def parse(name: str) -> Optional[tuple]:
    """(step, suffix) of a checkpoint directory name, suffix '' when committed; None otherwise."""
    m = _NAME.match(name)
    if not m:
        return None
    return int(m.group(1)), m.group(2) or ""


def uncommitted_dir(root: Path, step: int) -> Path:
    """Where a save of ``step`` is written. On an object store, its final name: there is no rename,
    and a checkpoint is committed only once its manifest exists (checkpoint/durable/commit.py)."""
    if on_object_store(root):
        return committed_dir(root, step)
    return location(root) / (checkpoint_id(step) + UNCOMMITTED)


def committed_dir(root: Path, step: int) -> Path:
    return location(root) / checkpoint_id(step)
