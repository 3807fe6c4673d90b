"""Measure recovery on this machine: MTTR after a SIGKILL and after a hang, and watchdog latency.

MTTR is from the failure to the first *completed* step after the resume: for a SIGKILL the
failure instant is when the fault fired (its marker, recovery/faults.py); for a hang it is
when the loop stopped beating. It includes torchrun noticing the death and restarting
the group, Python and torch start-up, building the model, loading and verifying the
checkpoint, and one step. Step completions are timed by tailing metrics.jsonl.

    python scripts/bench_recovery.py --nproc 1 --repeats 3 --hang-timeout-s 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from recovery.watchdog import read_records
from rehearsal.bench import MetricsTail, resumed, spread
from rehearsal.chains import faults_override, fired_at
from rehearsal.processes import child_env
from rehearsal.runs import prepare_debug_data, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


def run_once(kind: str, root: Path, data: Path, nproc: int, kill_step: int, hang_timeout_s: float) -> dict:
    run_dir = root / f"{kind}-{time.strftime('%H%M%S')}-{os.getpid()}"
    fault = {"kind": "sigkill" if kind == "sigkill" else "hang", "phase": "step", "step": kill_step}
    overrides = tiny_overrides(run_dir, data, kill_step + 8, 5, async_mode="async", extra=[
        faults_override([fault]), f"recovery.timeouts.step={hang_timeout_s}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=1", "--monitor-interval=0.1", str(ROOT / "train.py"), *overrides]
    tail = MetricsTail(run_dir / "metrics.jsonl")
    tail.start()
    with open(root / "bench.log", "a") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=child_env({"OMP_NUM_THREADS": "1"}), stdout=log,
                            stderr=subprocess.STDOUT, timeout=900).returncode
    time.sleep(0.05)
    tail.stop()
    if rc != 0 or resumed(tail.rows) is None:
        raise RuntimeError(f"{kind} run failed (rc {rc}, or no resumed step); see {root / 'bench.log'}")
    t_resumed, ev, t_first = resumed(tail.rows)
    failed_at = fired_at(run_dir)
    out = {"kind": kind, "resumed_from": ev["checkpoint_id"], "load_done_s": t_resumed - failed_at}
    if kind == "hang":
        rec = read_records(run_dir)[0]
        out["detection_s"] = rec["detected_at"] - rec["last_beat_at"]
        out["mttr_s"] = t_first - rec["last_beat_at"]
    else:
        out["mttr_s"] = t_first - failed_at
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--hang-timeout-s", type=float, default=5.0)
    p.add_argument("--root", type=Path, default=ROOT / "outputs" / "bench_recovery")
    p.add_argument("--data", type=Path, default=ROOT / "outputs" / "data" / "pydoc-byte")
    a = p.parse_args(argv)
    a.root.mkdir(parents=True, exist_ok=True)
    prepare_debug_data(a.data)  # the debug experiment's data, as train.py would build it
    results = []
    for i in range(a.repeats):
        for kind in ("sigkill", "hang"):
            r = run_once(kind, a.root, a.data.resolve(), a.nproc, a.kill_step, a.hang_timeout_s)
            results.append(r)
            print(json.dumps(r), flush=True)
    load = os.getloadavg()[0]
    print(f"\n{a.nproc} rank(s), load average {load:.1f} on {os.cpu_count()} cores; {a.repeats} repeats")
    for kind, key, what in (("sigkill", "mttr_s", "MTTR after SIGKILL (kill -> first resumed step)"),
                            ("hang", "detection_s", f"watchdog detection (timeout {a.hang_timeout_s:g} s)"),
                            ("hang", "mttr_s", "MTTR after a hang (last beat -> first resumed step)")):
        print(f"  {what:<55} {spread(r[key] for r in results if r['kind'] == kind)}")
    (a.root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
