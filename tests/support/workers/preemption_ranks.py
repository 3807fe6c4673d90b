"""Run by test_faults.py's preemption agreement test under torchrun: agreeing takes real ranks.

  torchrun --standalone --nproc-per-node 2 tests/support/workers/preemption_ranks.py

Each rank prints "STOP <rank> <step> <signal or 'peer'>" at the step boundary where it stops.
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from recovery.runtime import Preemption


def main() -> None:
    dist.init_process_group("gloo")
    pre = Preemption(["SIGUSR1"]).install()
    rank = dist.get_rank()
    for step in range(1, 10):
        if rank == 1 and step == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        if pre.agree()[0]:
            # one write() per line: two ranks share the pipe, print() may interleave them
            os.write(1, f"STOP {rank} {step} {pre.signal_name}\n".encode())
            break
    dist.destroy_process_group()



if __name__ == "__main__":
    main()
    # Leave without interpreter finalization: a gloo worker thread may still be freeing the last
    # collective's tensors, and taking the GIL while the interpreter shuts down aborts the process
    # ("terminate called without an active exception"; torch 2.13, about 1 run in 10 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
