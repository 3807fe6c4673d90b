"""Plot one or more runs' metrics.jsonl into one PNG (metrics/plots.py says what is drawn).

  python scripts/plot_metrics.py outputs/debug                                  # -> outputs/debug/metrics.png
  python scripts/plot_metrics.py outputs/rehearsal/STAMP/baseline outputs/rehearsal/STAMP/same_layout --out cmp.png

Panels: training and validation loss, LR, grad norm, tokens/s and MFU, checkpoint blocking and
background seconds; resumes are vertical lines, guard alarms markers on the loss. Several runs
overlay. Needs matplotlib (in the dev extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from metrics.plots import plot_runs
from metrics.records import METRICS_FILE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", type=Path, nargs="+", help="run directories holding metrics.jsonl")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default: FIRST_RUN_DIR/metrics.png)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    missing = [str(d) for d in a.run_dirs if not (d / METRICS_FILE).is_file()]
    if missing:
        print(f"error: no {METRICS_FILE} in {', '.join(missing)}", file=sys.stderr)
        return 2
    out = a.out or a.run_dirs[0] / "metrics.png"
    plot_runs(a.run_dirs, out, a.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
