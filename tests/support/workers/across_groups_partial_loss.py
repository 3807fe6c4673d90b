"""Run by test_agreement.py under torchrun: one replica group of two ranks at a step boundary of the guards with
torchft replica groups (recovery/guards/across_groups.py). The other group, which writes the durable checkpoints,
asked for a rollback to step 8 and was lost during the agreement across groups, after rank 0's all-reduce with its
counterpart had completed and before rank 1's had: rank 0 holds the agreed verdict, rank 1 torchft's error.

  torchrun --standalone --nproc-per-node 2 tests/support/workers/across_groups_partial_loss.py

torchft's manager is a stand-in (each rank's all-reduce goes to its own counterpart in the other groups: a partial
loss is one rank's); the two ranks and their group's agreement are real. Each rank prints "OUTCOME <rank> <what
step_boundary returned or raised>", then "BARRIER <rank>" once both reached the group's next collective.
"""

from __future__ import annotations

import datetime
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parallel import collectives
from recovery.guards.across_groups import AcrossGroups

OTHER_GROUP = ([1.0, 0.0, 1.0], [8.0, 0.0])  # its verdict (rollback, no error, writer), then its target


class Done:
    def wait(self) -> None:
        pass


class Manager:
    """torchft's Manager as AcrossGroups uses it: the MAX with the other group's values, or, on the rank whose
    counterpart was lost mid-way, the error torchft records instead of raising."""

    def __init__(self, lost: bool):
        self.lost, self.calls, self.error = lost, 0, None

    def allreduce(self, t: torch.Tensor, reduce_op) -> Done:
        if self.lost:
            self.error = RuntimeError("the peer replica group was lost during the all-reduce")
        else:
            t.copy_(torch.maximum(t, torch.tensor(OTHER_GROUP[self.calls], dtype=t.dtype)))
        self.calls += 1
        return Done()

    def errored(self):
        return self.error

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 1


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    rolled = []
    replicas = SimpleNamespace(manager=Manager(lost=rank == 1), world=SimpleNamespace(device=torch.device("cpu")),
                               cfg=SimpleNamespace(replica_id=1), writes_checkpoint=lambda: False,
                               rolled_back=lambda step, loaded: rolled.append(step))
    guards = SimpleNamespace(cfg=SimpleNamespace(replica_interval=0), after_update=lambda step: None,
                             _alarm=lambda *a: None, rollbacks=0, after_rollback=lambda: None)
    ckpt = SimpleNamespace(discard_memory=lambda: None, log_event=lambda *a, **k: None)
    try:
        got = AcrossGroups(replicas).step_boundary(guards, 12, ckpt, None, before_load=lambda: None)
        outcome = f"{got} rolled_back={rolled}"
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank met
        outcome = f"{type(exc).__name__}"
    sys.stdout.write(f"OUTCOME {rank} {outcome}\n")
    sys.stdout.flush()
    collectives.barrier()
    sys.stdout.write(f"BARRIER {rank}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
