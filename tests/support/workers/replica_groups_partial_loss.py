"""Run by test_agreement.py under torchrun: one replica group of two ranks under torchft
(parallel.fault_tolerance) when a peer group is lost part-way through a protocol across groups, so that one rank of
this group sees the loss and the other does not. Each rank's all-reduce across groups goes to its own counterpart,
and each rank configures its own process group at a quorum: a partial loss is one rank's.

  torchrun --standalone --nproc-per-node 2 tests/support/workers/replica_groups_partial_loss.py SCENARIO

SCENARIO:
- ``guards``: the guards' step boundary (recovery/guards/across_groups.py). The group that writes the durable
  checkpoints asked for a rollback to step 8; a third group was lost while rank 0's all-reduces with its
  counterparts completed and rank 1's did not.
- ``quorum``: the start of a step (recovery/fault_tolerance.py). Rank 1's part of the first quorum failed (its
  peer was lost while its process group was configured), rank 0's did not.
- ``quorum_fails``: as ``quorum``, but rank 1's part of every quorum fails: both ranks stop, each saying why.

torchft's manager is a stand-in; the two ranks and their group's agreement are real. Each rank prints
"OUTCOME <rank> <what it did>", then "BARRIER <rank>" once both reached the group's next collective.
"""

from __future__ import annotations

import datetime
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parallel import collectives

OTHER_GROUP = ([1.0, 0.0, 1.0], [8.0, 0.0])  # its verdict (rollback, no error, writer), then its target


class Done:
    def wait(self) -> None:
        pass


class Manager:
    """torchft's Manager as this group's code uses it. ``lost``: whether this rank's all-reduces meet the loss;
    ``failed_quorums``: how many of this rank's first quorums fail."""

    def __init__(self, lost: bool = False, failed_quorums: int = 0):
        self.lost, self.failed_quorums, self.calls, self.quorums, self.error = lost, failed_quorums, 0, 0, None

    def allreduce(self, t: torch.Tensor, reduce_op) -> Done:
        if self.lost:
            self.error = RuntimeError("the peer replica group was lost during the all-reduce")
        else:
            t.copy_(torch.maximum(t, torch.tensor(OTHER_GROUP[self.calls], dtype=t.dtype)))
        self.calls += 1
        return Done()

    def start_quorum(self) -> None:
        self.quorums += 1
        failed = self.quorums <= self.failed_quorums
        self.error = RuntimeError("configuring the process group: the peer is gone") if failed else None

    def errored(self):
        return self.error

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 1

    def current_step(self) -> int:
        return 12


def guards(rank: int) -> str:
    from recovery.guards.across_groups import AcrossGroups

    rolled = []
    replicas = SimpleNamespace(manager=Manager(lost=rank == 1), world=SimpleNamespace(device=torch.device("cpu")),
                               cfg=SimpleNamespace(replica_id=1), writes_checkpoint=lambda: False,
                               rolled_back=lambda step, loaded: rolled.append(step))
    guard = SimpleNamespace(cfg=SimpleNamespace(replica_interval=0), after_update=lambda step: None,
                            _alarm=lambda *a: None, rollbacks=0, after_rollback=lambda: None)
    ckpt = SimpleNamespace(discard_memory=lambda: None, log_event=lambda *a, **k: None)
    got = AcrossGroups(replicas).step_boundary(guard, 12, ckpt, None, before_load=lambda: None)
    return f"{got} rolled_back={rolled}"


def quorum(rank: int, failed_quorums: int = 1) -> str:
    from recovery.fault_tolerance import ReplicaGroups

    groups = object.__new__(ReplicaGroups)  # the parts start_step reads
    groups.manager = Manager(failed_quorums=failed_quorums if rank == 1 else 0)
    groups.cfg = SimpleNamespace(replica_id=1, lighthouse="stand-in", preserve_batch=True, groups=2)
    groups.state = SimpleNamespace(step=12)
    groups.group_plan = SimpleNamespace(dp_size=2, global_batch_size=8, micro_batch_size=1)
    groups.group_dp_rank = rank
    split = []
    data = SimpleNamespace(set_split=lambda plan, dp_rank: split.append(dp_rank), state_dict=lambda: {})
    step = groups.start_step(data)
    return f"step={step} quorums={groups.manager.quorums} dp_rank={split}"


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    try:
        outcome = {"guards": guards, "quorum": quorum,
                   "quorum_fails": lambda r: quorum(r, failed_quorums=99)}[sys.argv[1]](rank)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank met
        outcome = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(f"OUTCOME {rank} {outcome}\n")
    sys.stdout.flush()
    collectives.barrier()
    sys.stdout.write(f"BARRIER {rank}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
