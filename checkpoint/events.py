"""What the checkpoint tiers report: log lines and metrics.jsonl records (rank 0 writes them).

A durable save (``kind=checkpoint``), a save the storage refused (``kind=alarm``,
``check=checkpoint_save``), and the records other parts add through ``event`` (a memory snapshot,
a resume, a rollback, the interval chosen for ``interval=auto``).
docs/training.md lists the fields.
"""

from __future__ import annotations

import logging
from typing import Optional

from checkpoint.durable.discovery import checkpoint_id
from checkpoint.durable.saver import CheckpointSaveError, SaveRecord

log = logging.getLogger("trainer")


class CheckpointEvents:
    def __init__(self, metrics=None):
        self.metrics = metrics  # a MetricsLogger (metrics/logger.py), or None: log lines only

    def event(self, step: int, **fields) -> None:
        """A record in metrics.jsonl (rank 0), e.g. a resume or a rollback."""
        if self.metrics is not None:
            self.metrics.log_event(step, **fields)

    def save(self, r: SaveRecord) -> None:
        log.info("checkpoint %s (%s): blocked training %.3f s (%.3f s waiting for the previous save), "
                 "background %.3f s, %.1f MiB%s", r.checkpoint_id, r.mode, r.blocking_s, r.waited_s,
                 r.background_s, r.bytes / 2**20, ", committed" if r.committed else "")
        self.event(r.step, kind="checkpoint", checkpoint_id=r.checkpoint_id, mode=r.mode,
                   blocking_s=r.blocking_s, waited_s=r.waited_s, background_s=r.background_s,
                   bytes=r.bytes, committed=r.committed)

    def save_refused(self, exc: CheckpointSaveError, action: str, directory: str, free: Optional[int],
                     checkpoint_bytes: Optional[int]) -> None:
        """A save the storage refused: the log line (the whole message with action=continue) and the alarm."""
        if action == "stop":  # the whole message ends the run (train.py prints it)
            log.error("%s; stopping (checkpoint.on_save_error=stop)", str(exc).splitlines()[0])
        else:
            log.error("checkpoint.on_save_error=continue, training goes on: %s", exc)
        self.event(exc.step, kind="alarm", check="checkpoint_save", action=action,
                   checkpoint_id=checkpoint_id(exc.step), errno=exc.errno, directory=directory,
                   free_bytes=free, checkpoint_bytes=checkpoint_bytes, message=str(exc).splitlines()[0])
