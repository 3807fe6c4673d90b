"""Run by test_agreement.py under torchrun: rank 0 decides for every rank (``decided_on_rank0``) three times,
each decision taking twice the collective timeout (a listing of a slow store, reads retried with a
backoff): an answer, an error its caller listed, one it did not.

  torchrun --standalone --nproc-per-node 2 tests/support/workers/rank0_slow_decision.py

The process group times out after TIMEOUT_S (2 s) and the ranks agree every 0.5 s (AGREED_POLL_S) whether
rank 0 is still at it. Each rank prints "DECIDED <rank> <what it got>" for each decision, then "BARRIER <rank>".
"""

from __future__ import annotations

import datetime
import sys
import time

import torch.distributed as dist

from parallel import collectives

TIMEOUT_S = 2.0


def slow(outcome):
    def decide():
        time.sleep(2 * TIMEOUT_S)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    return decide


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    collectives.AGREED_POLL_S = TIMEOUT_S / 4
    rank = dist.get_rank()
    for outcome in ("step_00000398", OSError(5, "the store did not answer"), ValueError("bytes it did not expect")):
        try:
            got = collectives.decided_on_rank0(slow(outcome), errors=(OSError,))
            sys.stdout.write(f"DECIDED {rank} {got}\n")
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank met
            sys.stdout.write(f"DECIDED {rank} {type(exc).__name__}: {exc}\n")
        sys.stdout.flush()
    collectives.barrier()
    sys.stdout.write(f"BARRIER {rank}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
