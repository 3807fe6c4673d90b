"""Run by test_faults.py's sigkill test: the fault SIGKILLs the process that hits it, so it gets its own.

  python tests/support/workers/fault_sigkill.py RUN_DIR

Prints "survived N" after each checkpoint_write phase of steps 1..6; the fault fires at step 4,
once per run directory.
"""

from __future__ import annotations

import sys

from recovery.faults import FaultInjector


def main() -> None:
    faults = FaultInjector([{"kind": "sigkill", "phase": "checkpoint_write", "step": 4}], sys.argv[1], 0)
    for step in range(1, 7):
        faults.maybe_inject("checkpoint_write", step)
        print("survived", step, flush=True)


if __name__ == "__main__":
    main()
