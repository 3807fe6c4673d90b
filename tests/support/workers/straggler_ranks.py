"""Run by test_watchdog.py's straggler test under torchrun: the report gathers step times from real ranks.

  torchrun --standalone --nproc-per-node 3 tests/support/workers/straggler_ranks.py

Each rank prints "REPORT <rank> <slow ranks> <last report>"; the monitor logs the straggler.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from recovery.runtime import StragglerMonitor


def main() -> None:
    logging.basicConfig(level="WARNING", format="%(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mon = StragglerMonitor(interval=2, factor=1.5)
    slow = []
    for step in (1, 2):
        slow = mon.record(step, 0.3 if rank == 1 else 0.1)
    sys.stdout.write(f"REPORT {rank} {slow} {mon.last_report}\n")  # one write: ranks share the pipe
    sys.stdout.flush()
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be freeing the last
    # collective's tensors, and taking the GIL while the interpreter shuts down aborts the process
    # ("terminate called without an active exception"; torch 2.13, about 1 run in 10 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
