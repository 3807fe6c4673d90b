"""Recovery rehearsal through torchrun: kill a real run, let it resume, compare the losses.

  1. baseline:  N steps at --nproc ranks, fixed seed, no faults;
  2. same layout: the same run with a SIGKILL on a seeded random rank at a seeded random
     step; torchrun --max-restarts 1 restarts the group in place (or, with --relaunch, the
     job is launched again), resume=auto picks the newest committed checkpoint; every logged
     step must equal the baseline bit for bit;
  3. smaller world: the same kill with no restart left (the job dies, as when a node is
     lost), then a relaunch at --small-nproc ranks: grad_accum_steps is recomputed so the
     global batch is unchanged; the steps after the resume must match within --rtol
     (a different reduction order changes the last bits; contract 2);
then a report table and, next to report.json, losses.png: the three runs' curves overlaid
(metrics/plots.py; resumes as vertical lines); the exit status is non-zero on any divergence.

    python scripts/rehearse.py --nproc 2 --small-nproc 1 --steps 12 --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

from metrics.plots import plot_runs
from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.processes import child_env
from rehearsal.runs import prepare_debug_data, tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, overrides, max_restarts: int, log: Path, timeout_s: float) -> tuple:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", str(ROOT / "train.py"), *overrides]
    t0 = time.monotonic()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=child_env({"OMP_NUM_THREADS": "1"}), stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode
    return rc, time.monotonic() - t0


def compare(baseline: dict, run_dir: Path, after_step: int, rtol: float) -> dict:
    """Worst relative difference over the steps after ``after_step`` and whether it is allowed."""
    rows = [r for r in read_metrics(run_dir) if r["step"] > after_step]
    worst, bad = 0.0, []
    for r in rows:
        ref = baseline[r["step"]]
        diff = abs(r["loss"] - ref) / abs(ref)
        worst = max(worst, diff)
        if not (r["loss"] == ref if rtol == 0 else diff <= rtol) or not math.isfinite(r["loss"]):
            bad.append(r["step"])
    missing = sorted(set(s for s in baseline if s > after_step) - {r["step"] for r in rows})
    return {"steps": len(rows), "worst_rel_diff": worst, "diverged": bad, "missing": missing,
            "ok": not bad and not missing and bool(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--small-nproc", type=int, default=None, help="default: nproc // 2 (0 skips)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--seed", type=int, default=7, help="draws the kill step and rank")
    p.add_argument("--rtol", type=float, default=1e-5, help="loss tolerance after a change of world size")
    p.add_argument("--root", type=Path, default=ROOT / "outputs" / "rehearsal")
    p.add_argument("--data", type=Path, default=ROOT / "outputs" / "data" / "pydoc-byte")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--relaunch", action="store_true",
                   help="after the kill, launch the job again (a scheduler requeue) instead of letting "
                        "torchrun --max-restarts 1 restart the group in place")
    a = p.parse_args(argv)
    small = a.nproc // 2 if a.small_nproc is None else a.small_nproc
    prepare_debug_data(a.data)  # the debug experiment's data, with its held-out validation split
    rng = random.Random(a.seed)
    kill_step = rng.randint(a.interval + 1, a.steps - 1)
    kill_rank = rng.randrange(a.nproc)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = a.root / stamp
    root.mkdir(parents=True, exist_ok=True)
    log = root / "rehearsal.log"
    ov = lambda name, *extra: tiny_overrides(root / name, a.data.resolve(), a.steps, a.interval, keep_last=2,  # noqa: E731
                                             async_mode="async", extra=extra)
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": kill_step, "rank": kill_rank}])
    print(f"rehearsal in {root}: {a.steps} steps, checkpoint every {a.interval}, SIGKILL rank {kill_rank} "
          f"at step {kill_step} (seed {a.seed})", flush=True)

    rows = []
    rc, secs = torchrun(a.nproc, ov("baseline"), 0, log, a.timeout_s)
    if rc != 0:
        print(f"baseline failed ({rc}); see {log}")
        return 2
    baseline = step_losses(root / "baseline")

    if not a.relaunch:
        rc, secs = torchrun(a.nproc, ov("same_layout", kill), 1, log, a.timeout_s)
    else:
        rc1, s1 = torchrun(a.nproc, ov("same_layout", kill), 0, log, a.timeout_s)
        rc, s2 = torchrun(a.nproc, ov("same_layout", kill), 0, log, a.timeout_s)
        rc, secs = (rc if rc1 != 0 else -1), s1 + s2  # the first launch must have died
    resumed = read_metrics(root / "same_layout", "resume")
    res = compare(baseline, root / "same_layout", 0, 0.0)
    res.update(ok=res["ok"] and rc == 0 and bool(resumed))
    rows.append(("same layout", f"{a.nproc}->{a.nproc}", resumed[0]["checkpoint_id"] if resumed else "-", rc, secs,
                 "bitwise", res))

    if small:
        run = root / "smaller_world"
        rc1, s1 = torchrun(a.nproc, ov("smaller_world", kill), 0, log, a.timeout_s)
        rc2, s2 = torchrun(small, ov("smaller_world", kill), 0, log, a.timeout_s)
        resumed = read_metrics(run, "resume")
        after = resumed[0]["step"] if resumed else 0
        res = compare(baseline, run, after, a.rtol)
        res.update(ok=res["ok"] and rc1 != 0 and rc2 == 0 and bool(resumed))
        rows.append(("smaller world", f"{a.nproc}->{small}", resumed[0]["checkpoint_id"] if resumed else "-", rc2,
                     s1 + s2, f"rtol {a.rtol:g}", res))

    print(f"\n{'scenario':<14} {'ranks':>6} {'resumed from':>14} {'rc':>3} {'secs':>6} {'rule':>11} "
          f"{'steps':>5} {'worst rel diff':>15} {'verdict':>8}")
    for name, ranks, ck, rc, secs, rule, res in rows:
        print(f"{name:<14} {ranks:>6} {ck:>14} {rc:>3} {secs:>6.1f} {rule:>11} {res['steps']:>5} "
              f"{res['worst_rel_diff']:>15.3e} {'OK' if res['ok'] else 'DIVERGED':>8}")
        if not res["ok"]:
            print(f"   diverged steps {res['diverged']}, missing steps {res['missing']}; log: {log}")
    (root / "report.json").write_text(json.dumps([dict(zip(("scenario", "ranks", "resumed_from", "rc", "seconds",
                                                             "rule", "result"), r)) for r in rows], indent=1))
    runs = [root / name for name in ("baseline", "same_layout", "smaller_world") if (root / name).is_dir()]
    try:
        plot_runs(runs, root / "losses.png", title=f"rehearsal {stamp}: baseline vs killed and resumed")
        print(f"report {root / 'report.json'}, plot {root / 'losses.png'}")
    except SystemExit as no_matplotlib:  # the verdict does not depend on the picture
        print(f"report {root / 'report.json'}; no plot: {no_matplotlib}")
    return 0 if all(r[-1]["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
