"""Run by test_agreement.py under torchrun: rank 0, deciding for every rank (``decided_on_rank0``), meets an
error nobody listed; each rank catches what it is raised (as a caller that trains past a failed decision
would) and goes on to the next collective.

  torchrun --standalone --nproc-per-node 2 tests/support/workers/rank0_raises.py

Each rank prints "RAISED <rank> <type>: <message>", then "BARRIER <rank>" once every rank is past the next
collective.
"""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

from parallel import collectives


def decide() -> str:
    raise ValueError("rank 0's read met bytes it did not expect")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    try:
        collectives.decided_on_rank0(decide, errors=(OSError,))
        sys.stdout.write(f"RAISED {rank} nothing\n")
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank met
        sys.stdout.write(f"RAISED {rank} {type(exc).__name__}: {exc}\n")
    sys.stdout.flush()
    collectives.barrier()
    sys.stdout.write(f"BARRIER {rank}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
