"""Run by test_watchdog.py's hang tests: the watchdog aborts the process it guards, so it gets its own.

  python tests/support/workers/watchdog_hang.py RUN_DIR sleep|gil HARD_MARGIN_S

Allows core dumps as a cluster job may (``ulimit -c unlimited``: the hard limit) and works in RUN_DIR,
where a core would be written. Beats once at step 4 (step timeout 1 s), prints the wall time of that beat,
then hangs:
"sleep" releases the GIL (the Python watchdog thread fires), "gil" holds it for ages (only
the C guard, faulthandler, can fire).
"""

from __future__ import annotations

import os
import re
import resource
import sys
import time

from recovery.watchdog import Watchdog


def main() -> None:
    run_dir, how, hard_margin_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    os.chdir(run_dir)
    wd = Watchdog(run_dir, rank=0, timeouts={"step": 1.0}, hard_margin_s=hard_margin_s).start()
    wd.beat("step", 4)
    print(time.time(), flush=True)
    if how == "sleep":
        time.sleep(60)  # releases the GIL: the Python watchdog thread fires
    else:
        re.match(r"(a+)+$", "a" * 64 + "b")  # holds the GIL for ages: only the C guard can fire


if __name__ == "__main__":
    main()
