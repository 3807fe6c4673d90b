"""Run by test_train_run.py: run a script (as ``python SCRIPT ARGS``) and print its own peak RSS.

A separate process because the test's own children include every earlier test's processes:
``RUSAGE_CHILDREN`` would report the largest of them, not this one.

  python tests/support/workers/peak_rss.py SCRIPT [ARGS ...]     # last stderr line: peak_rss_kib N
"""

import resource
import runpy
import sys

script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print(f"peak_rss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr, flush=True)
