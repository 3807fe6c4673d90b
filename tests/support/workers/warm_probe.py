"""Run by tests/integration/test_warm_launcher.py, cold and forked from the warm parent: reports what a program
sees of its process (argv, cwd, environment, ranks, threads, stream buffering) and exits as told.

  python tests/support/workers/warm_probe.py EXIT_CODE [fail_rank] [sleep_s]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def main() -> None:
    code = int(sys.argv[1])
    fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    rank = int(os.environ.get("RANK", "0"))
    report = {"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "pid": os.getpid(),
              "probe": os.environ.get("WARM_PROBE"), "rank": rank, "world": os.environ.get("WORLD_SIZE"),
              "local_world": os.environ.get("LOCAL_WORLD_SIZE"), "threads": torch.get_num_threads(),
              "path0": sys.path[0], "stdout_line_buffered": sys.stdout.line_buffering}
    os.write(1, (json.dumps(report) + "\n").encode())  # one write per rank: ranks share the pipe
    print("to stderr", file=sys.stderr)
    if rank == fail_rank:
        sys.exit(code)
    time.sleep(sleep_s)
    if fail_rank == -1:
        sys.exit(code)


if __name__ == "__main__":
    main()
