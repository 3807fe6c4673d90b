"""The guards with replica groups under torchft (parallel.fault_tolerance, recovery/fault_tolerance.py): one
verdict across the groups of the quorum, and one action.

Each group is its own torchrun job with its own guards. Their per-step inputs (the loss and the gradient norms)
are the sums over every group, the same bits everywhere, but the step boundary's checks are not: a rollback one
group's guards ask for must be done by every group, or that group goes back while the others train on. So at
every step boundary each group's ranks agree among themselves (the guards' own agreement), then the groups agree
through torchft (one small MAX over the quorum); every rank of every group reaches that point, also when its
group's guards raised, which then stops that group alone (a lost group to the others). A rollback is done by the
group that writes the step's durable checkpoint, the quorum's first (recovery/guards/rollback.py: the verified
target, the data skip, the re-save); the others, told its target, set torchft's step one below it, so the next
quorum sends them that group's state (torchft heals a group behind the quorum's step): every group then holds the
same bits.

The guards' replica check compares weight fingerprints across the dp_replicate ranks of one job; here each group
is a job of its own, so the check compares them across the groups of the quorum instead (a bit flipped in one
group's weights that no loss noticed).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from parallel import collectives
from recovery.guards.guard import Anomaly, disagreeing_replicas, param_fingerprint
from recovery.guards.rollback import RollbackError, RollbackRequested, roll_back

log = logging.getLogger("trainer")


class AcrossGroups:
    def __init__(self, replicas):
        """``replicas``: this rank's ReplicaGroups (recovery/fault_tolerance.py): its torchft ``manager``, whether
        its group writes this step's durable checkpoint (``writes_checkpoint()``: the quorum's first group), and
        ``rolled_back(step, loaded)`` for torchft's step."""
        self.replicas, self.manager = replicas, replicas.manager
        self.device, self.replica_id = replicas.world.device, replicas.cfg.replica_id

    def _agree(self, values) -> Optional[list]:
        """The MAX of ``values`` over the groups, the same on every rank of this group; None on all of them only
        when none of them got it (a peer lost during it). Each rank's all-reduce goes to its own counterparts in
        the other groups, so a group killed mid-way can leave one rank with the result and another without: the
        ranks that got it give it to the others (one small MAX within the group; none for a one-process group).
        Going on alone instead would, with three groups or more, undo a live writer's rollback: this group
        would train on, and the next quorum would heal the writer from it."""
        agreed = collectives.agree_max_across_replicas([float(v) for v in values], self.manager, self.device)
        have = agreed is not None
        shared = collectives.agree_max([float(have)] + (agreed if have else [-math.inf] * len(values)))
        return shared[1:] if shared[0] else None

    def step_boundary(self, guards, step: int, ckpt, data, before_load: Callable[[], None]) -> Optional[int]:
        """The guards' checks after the update of 1-based ``step``, agreed across the groups; the step to go on from
        after a rollback, else None (recovery/guards/guard.py's step_boundary, with replica groups)."""
        request = error = None
        try:
            self._replica_check(guards, step)  # first: a collective every group runs at the same steps
            guards.after_update(step)
        except RollbackRequested as exc:
            request = exc
        except Exception as exc:  # noqa: BLE001 - raised after the agreement, which the other groups wait for
            error = exc
        writer = self.replicas.writes_checkpoint()
        agreed = self._agree([request is not None, error is not None, writer])
        if error is not None:
            raise error
        alone = agreed is None  # a peer lost during the agreement: this group's own verdict, and no second agreement
        if alone:  # (torchft's next quorum heals whichever group is behind)
            agreed = [request is not None, 0.0, writer]
        if not agreed[0]:
            return None
        if request is None:
            request = RollbackRequested(step, "another replica group's guards asked for a rollback")
            guards._alarm(step, "replica_group", "rollback", [Anomaly("replica_group", 1.0, 0.0, request.reason)])
        if not agreed[2]:
            raise RollbackError(f"{request}, but the replica group that writes this step's checkpoint was lost during "
                                "the agreement: this group cannot roll back alone; its restart takes the live state "
                                "from a peer (or restart from a known-good checkpoint with checkpoint.resume=<path>)")
        before_load()
        target, failure = -1, None
        if writer:
            try:
                target = roll_back(request, guards, ckpt, data,
                                   after_load=lambda loaded: self.replicas.rolled_back(loaded, loaded=True))
            except Exception as exc:  # noqa: BLE001 - the others learn it at the next agreement, then all stop
                failure = exc
        agreed = None if alone else self._agree([target, failure is not None])
        if failure is not None:
            raise failure
        if writer:  # rolled back: it goes on, whether or not the others could be told (those not told stop)
            return target
        if agreed is None or agreed[1] or agreed[0] < 0:
            raise RollbackError(f"{request}: the replica group that writes the durable checkpoints could not roll "
                                f"back{' (lost during the agreement)' if agreed is None else ''}; see its log")
        target = int(agreed[0])  # behind the writer's step: torchft's next quorum sends this group that state
        guards.rollbacks += 1
        guards.after_rollback()
        ckpt.discard_memory()
        self.replicas.rolled_back(target, loaded=False)
        log.warning("replica group %d: rolled back with the group that writes the durable checkpoints from step %d to "
                    "step %d; its state comes at the next quorum", self.replica_id, step, target)
        ckpt.log_event(step, kind="rollback", to_step=target, reason=request.reason, replica_group=True)
        return target

    def _replica_check(self, guards, step: int) -> None:
        """Every ``recovery.guards.replica_interval`` steps with two groups or more in the quorum: each rank's weight
        fingerprint against the same rank's of the other groups. Weights that differ are a replica alarm, which
        rolls back (recovery/guards/guard.py)."""
        every, count, index = guards.cfg.replica_interval, self.manager.num_participants(), \
            self.manager.participating_rank()
        if every <= 0 or step % every or count < 2 or index is None:
            return
        fingerprints = collectives.gather_across_replicas(int(param_fingerprint(guards.model, self.device)), index,
                                                          count, self.manager, self.device)
        bad = disagreeing_replicas(fingerprints) if fingerprints is not None else []
        if not collectives.any_rank(bool(bad)):  # this group's ranks agree: one rank's shard differing is enough
            return
        who = f"quorum rank(s) {bad} of {count} differ from the majority" if 0 < len(bad) < count else \
            f"all {count} groups disagree (no majority{' with 2 groups' if count == 2 else ''})" if bad else \
            "on another rank of this group"
        guards._escalate(step, "replica", [Anomaly("replica_group_fingerprint", float(len(bad)), 0.0,
                                                   f"weights differ across replica groups: {who}")])
