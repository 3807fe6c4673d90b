"""``parallel.fault_tolerance.*``: the settings of replica groups under torchft (recovery/fault_tolerance.py), and
what they cannot be with the other sections. Torch-free: the config checks import it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from configs.keys import AT_LEAST_1, NON_NEGATIVE, SECONDS, key


@dataclass
class FaultToleranceConfig:
    """``parallel.fault_tolerance.*``: replica groups managed by torchft (recovery/fault_tolerance.py). Each group is
    its own torchrun job (dp_shard x tp ranks); a lost group does not stop the others."""

    enabled: bool = key(False, "replica groups managed by torchft: the others go on while one is out, a restarted "
                        "group takes the live state from a peer (docs/recovery-runbook.md, \"Fault tolerance\")")
    lighthouse: str = key("", "the torchft Lighthouse's address, e.g. http://127.0.0.1:29510 "
                          "(scripts/launch_fault_tolerant.sh starts it)")
    replica_id: int = key(0, "this group's number, 0 to groups - 1; a step's durable save is written by the lowest "
                          "number in its quorum (the groups share checkpoint.dir)",
                          NON_NEGATIVE)
    groups: int = key(2, "replica groups the job launches (the batch split is checked for every count the "
                      "quorum may have, min_replicas to groups)", AT_LEAST_1)
    min_replicas: int = key(1, "a step commits only with at least this many groups in its quorum", AT_LEAST_1)
    preserve_batch: bool = key(True, "the groups of a step's quorum read the whole global batch between them (a "
                               "missing group's micro-batches go to the others); false: torchft's own semantics, "
                               "each group reads its fixed share and a missing group's samples are skipped")
    hostname: str = key("", "the address this group's torchft manager advertises to its peers, and the only one "
                        "its servers listen on; 127.0.0.1 on one host (empty: the host's name is advertised and "
                        "torchft listens on every interface)")
    quorum_timeout_s: float = key(60.0, "a step waits this long for its quorum before failing (a survivor waits "
                                  "here while a peer's loss is detected)", SECONDS)
    timeout_s: float = key(30.0, "torchft's operations: the gradient all-reduce across groups, the commit vote, a "
                           "weight transfer to a rejoining group", SECONDS)

    def check(self) -> List[str]:
        if not self.enabled:
            return []
        out = []
        if not self.lighthouse:
            out.append("parallel.fault_tolerance.enabled=true needs parallel.fault_tolerance.lighthouse (the "
                       "Lighthouse's address, e.g. http://127.0.0.1:29510; scripts/launch_fault_tolerant.sh starts "
                       "one and passes it)")
        if self.replica_id >= self.groups:
            out.append(f"parallel.fault_tolerance.replica_id={self.replica_id} is not below "
                       f"parallel.fault_tolerance.groups={self.groups}: number the groups 0 to {self.groups - 1}")
        if self.min_replicas > self.groups:
            out.append(f"parallel.fault_tolerance.min_replicas={self.min_replicas} is above "
                       f"parallel.fault_tolerance.groups={self.groups}: no step could ever commit; lower "
                       f"min_replicas to at most {self.groups} or launch more groups")
        return out

    def quorum_sizes(self) -> range:
        """Every number of groups a step's quorum may have: each must split the global batch (preserve_batch), or
        only the full count (torchft's own semantics, each group its fixed share)."""
        return range(self.min_replicas, self.groups + 1) if self.preserve_batch else range(self.groups, self.groups + 1)

    def problems_with(self, dp_replicate: int, watchdog: bool, timeouts: Dict[str, float]) -> List[str]:
        """What these settings cannot be with the others: the group's own mesh, and the watchdog's timeouts
        against torchft's (a survivor waits for its quorum in the data_wait phase, and for the all-reduce across
        groups in the step phase: the watchdog must not abort it there)."""
        if not self.enabled:
            return []
        out = []
        if dp_replicate != 1:
            out.append(f"parallel.fault_tolerance.enabled=true with parallel.dp_replicate={dp_replicate}: each "
                       "replica group is its own torchrun job whose mesh is dp_shard x tp; set parallel.dp_replicate=1 "
                       f"and launch {dp_replicate} groups (parallel.fault_tolerance.groups={dp_replicate}, "
                       "scripts/launch_fault_tolerant.sh)")
        if watchdog:
            limits = {phase: timeouts.get(phase, timeouts.get("step", 120.0)) for phase in ("data_wait", "step")}
            for phase, needs, what in (("data_wait", self.quorum_timeout_s + self.timeout_s, "quorum_timeout_s + "
                                        "timeout_s (the quorum and a weight transfer to this group)"),
                                       ("step", self.timeout_s, "timeout_s (the all-reduce across groups)")):
                if limits[phase] <= needs:
                    out.append(f"recovery.timeouts.{phase}={limits[phase]:g} s is not above parallel.fault_tolerance."
                               f"{what} = {needs:g} s: the watchdog would abort a survivor waiting on torchft; raise "
                               f"recovery.timeouts.{phase} above {needs:g} or lower the torchft timeouts")
        return out

    def checkpoint_problems(self, checkpoint_dir: Optional[str], run_dir: str) -> List[str]:
        """The groups share checkpoint.dir (each step's save is written by one group: recovery/fault_tolerance.py);
        one inside the group's own run_dir (the default, ${run_dir}/checkpoints) would hold only the steps this
        group wrote, and a cold start could resume from an older one than the newest. ``checkpoint_dir``: its
        local path, None for an object store's URL (shared by every group)."""
        if not self.enabled or checkpoint_dir is None:
            return []
        ckpt, run = os.path.abspath(checkpoint_dir), os.path.abspath(run_dir)
        if os.path.commonpath([ckpt, run]) != run:
            return []
        return [f"checkpoint.dir={checkpoint_dir} is inside this replica group's run_dir={run_dir}: the groups share "
                "one checkpoint.dir (a step's save is written by one group, the lowest in its quorum); set "
                "checkpoint.dir to the same folder outside the groups' run_dirs for every group "
                "(scripts/launch_fault_tolerant.sh passes RUN_DIR/checkpoints)"]
