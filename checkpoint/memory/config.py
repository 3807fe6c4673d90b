"""The memory tier's sub-section (``checkpoint.memory.*``), torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from configs.keys import NON_NEGATIVE, Bound, key, step_count_or_auto


@dataclass
class MemoryTierConfig:
    """The in-memory tier (checkpoint/memory/): node-local snapshots with a replica on a peer node."""

    interval: str = key("0", "steps between snapshots; 0 turns the tier off; auto: Young/Daly from the measured "
                        "snapshot stall")
    replicas: int = key(1, "0: own node only | 1: also on the peer node (the same local rank, next node)",
                        Bound(0, 1))
    root: Optional[str] = key(None, "a tmpfs folder; null: /dev/shm/<user>/<run_name>")
    node: Optional[int] = key(None, "several nodes on one host (tests): each gets root/node-<node>; null: one node "
                              "per host", NON_NEGATIVE)
    required: bool = key(True, "false: a pre-flight failure (no room in root) leaves the run on the durable tier")

    @property
    def enabled(self) -> bool:
        """The tier is on (a step count > 0, or auto); a value check() refuses is off here."""
        try:
            return step_count_or_auto(self.interval, "checkpoint.memory.interval") != 0
        except ValueError:
            return False

    @property
    def folder(self) -> Optional[str]:
        """The root the pre-flight checks: a required tier's own (its default, /dev/shm/..., the tier checks)."""
        return self.root if self.root and self.required and self.enabled else None

    def check(self) -> List[str]:
        try:
            step_count_or_auto(self.interval, "checkpoint.memory.interval")
        except ValueError as exc:
            return [str(exc)]
        return []
