"""Before step 1: can the checkpoint directory take a checkpoint at all?

Checked: it exists (or can be created), this process can write and fsync a file there, and
it has free space for at least one checkpoint of the expected size (a warning when it has
less than keep_last + 1, the most retention keeps while a new save is written).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("trainer")


class PreflightError(RuntimeError):
    """The checkpoint directory cannot hold a checkpoint; the message names the path and numbers."""


def expected_checkpoint_bytes(model: torch.nn.Module, optimizer_states: int = 2, ema: bool = False) -> int:
    """Global size of model + AdamW moments (+ EMA); ``numel`` of a DTensor is its global size."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (1 + optimizer_states + (1 if ema else 0))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def preflight_checkpoint_dir(root: Path, expected_bytes: int, keep_last: int, rank: int) -> None:
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreflightError(f"checkpoint.dir={root} does not exist and cannot be created: {exc}") from exc
    probe = root / f".preflight-rank{rank}-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise PreflightError(f"checkpoint.dir={root} is not writable by this process: {exc}") from exc
    free = shutil.disk_usage(root).free
    if free < expected_bytes * 1.05:
        raise PreflightError(
            f"checkpoint.dir={root} has {_gib(free)} free but one checkpoint needs about {_gib(expected_bytes)}; "
            "free space, point checkpoint.dir elsewhere, or set checkpoint.interval=0 to train without saving")
    if rank == 0 and free < expected_bytes * (keep_last + 1):
        log.warning("checkpoint.dir=%s has %s free: less than keep_last + 1 = %d checkpoints of %s",
                    root, _gib(free), keep_last + 1, _gib(expected_bytes))
