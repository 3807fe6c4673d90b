"""Recovery rehearsal: kill training at seeded random points, check it resumes exactly.

A rehearsal is a baseline run plus *chains*: runs of the same config, each with a few
faults armed (recovery/faults.py fires each once), restarted by rehearsal/supervisor.py
until they finish. Every chain must
  - finish, with one death per armed fault;
  - after each death resume from the newest committed checkpoint at the moment of death;
  - log, for every step it ran (re-run steps included), the baseline's loss bit for bit.

Kill points are drawn per phase from the steps where that phase happens: any step for
``data_wait``/``step``, checkpoint steps for the save phases, the deleted checkpoints'
steps for ``checkpoint_retention``, and the first load after a death for ``checkpoint_load``
(its chain also kills right after a commit, so a load is guaranteed to happen).

    python -m rehearsal.chains --root /tmp/rehearsal --data outputs/data/pydoc-byte --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Dict, List, Sequence

from metrics.records import read_metrics, step_losses
from recovery.config import SAVE_PHASES
from rehearsal.runs import tiny_overrides
from rehearsal.supervisor import supervise

ALL_PHASES = ("data_wait", "step") + SAVE_PHASES + ("checkpoint_retention", "checkpoint_load")


def phase_steps(phase: str, steps: int, interval: int, keep_last: int) -> List[int]:
    """The steps at which ``phase`` happens in an uninterrupted run."""
    saves = sorted(set(range(interval, steps + 1, interval)) | {steps})
    if phase in ("data_wait", "step"):
        return list(range(1, steps + 1))
    if phase in SAVE_PHASES:
        return saves
    if phase == "checkpoint_retention":
        return saves[:-keep_last] if len(saves) > keep_last else []
    if phase == "checkpoint_load":
        return [-1]
    raise ValueError(f"unknown phase {phase!r}")


def plan_chains(n_kills: int, n_chains: int, seed: int, steps: int, interval: int, keep_last: int,
                phases: Sequence[str] = ALL_PHASES, extra_kinds: Sequence[str] = ("exception",)) -> List[List[dict]]:
    """``n_kills`` distinct SIGKILL points (every phase covered) spread over ``n_chains`` chains."""
    rng = random.Random(seed)
    points: List[tuple] = []
    candidates = [(p, s) for p in phases for s in phase_steps(p, steps, interval, keep_last) if p != "checkpoint_load"]
    per_phase = [p for p in phases if p != "checkpoint_load" and phase_steps(p, steps, interval, keep_last)]
    for p in per_phase:  # one of each phase first, then uniformly at random
        points.append((p, rng.choice(phase_steps(p, steps, interval, keep_last))))
    rest = [c for c in candidates if c not in points]
    rng.shuffle(rest)
    n_load = min(n_chains, max(1, n_kills // 10)) if "checkpoint_load" in phases else 0
    points += rest[:max(0, n_kills - len(points) - n_load)]
    rng.shuffle(points)
    chains: List[List[dict]] = [[] for _ in range(n_chains)]
    for i, (p, s) in enumerate(points):
        chains[i % n_chains].append({"kind": "sigkill", "phase": p, "step": s})
    for c in range(n_load):  # a kill right after a commit guarantees a later load to kill
        if not any(f["phase"] == "checkpoint_committed" for f in chains[c]):
            committed = [s for p, s in candidates if p == "checkpoint_committed" and s < steps]
            chains[c].append({"kind": "sigkill", "phase": "checkpoint_committed", "step": rng.choice(committed)})
        chains[c].append({"kind": "sigkill", "phase": "checkpoint_load", "step": -1})
    for j, kind in enumerate(extra_kinds):  # a crash that is not a kill: an exception
        chains[(n_chains - 1 - j) % n_chains].append({"kind": kind, "phase": "step", "step": rng.randint(2, steps)})
    return chains


def faults_override(faults: Sequence[dict]) -> str:
    return "recovery.faults=[" + ",".join("{" + ",".join(f"{k}:{v}" for k, v in f.items()) + "}" for f in faults) + "]"


def divergences(baseline: Dict[int, float], run_dir: Path, rtol: float = 0.0) -> List[str]:
    """Every logged step whose loss differs from the baseline (bitwise when rtol == 0)."""
    out = []
    seen = set()
    for r in read_metrics(run_dir):
        s, loss = r["step"], r["loss"]
        seen.add(s)
        ref = baseline.get(s)
        if ref is None:
            out.append(f"step {s}: not in the baseline")
        elif not (loss == ref if rtol == 0 else math.isclose(loss, ref, rel_tol=rtol)):
            out.append(f"step {s}: loss {loss!r} != baseline {ref!r}")
    missing = sorted(set(baseline) - seen)
    if missing:
        out.append(f"steps never logged: {missing}")
    return out


def fired_pids(run_dir: Path) -> Dict[int, str]:
    """pid -> fault name, from the fault markers (recovery/faults.py)."""
    out = {}
    for m in (Path(run_dir) / "faults").glob("fired-*"):
        fields = m.read_text().split()
        out[int(fields[fields.index("pid") + 1])] = m.name
    return out


def fired_at(run_dir: Path) -> float:
    """When (time.time()) the run's injected fault fired, from its marker (recovery/faults.py)."""
    fields = next((Path(run_dir) / "faults").glob("fired-*")).read_text().split()
    return float(fields[fields.index("time") + 1])


def resume_problems(run_dir: Path, attempts: List[dict]) -> List[str]:
    """Each restart after a death must resume from the newest committed checkpoint at that death."""
    expected = []
    killed_in_load = {pid for pid, name in fired_pids(run_dir).items() if "checkpoint_load" in name}
    for prev, cur in zip(attempts, attempts[1:]):
        if prev["newest_committed_after"] is None or cur["pid"] in killed_in_load:
            continue
        expected.append(prev["newest_committed_after"])
    got = [e["checkpoint_id"] for e in read_metrics(run_dir, "resume")]
    return [] if got == expected else [f"resumed from {got}, expected (newest committed at each death) {expected}"]


def run_rehearsal(root: Path, data_dir: Path, n_kills: int, n_chains: int, seed: int, steps: int, interval: int,
                  keep_last: int = 2, async_mode: str = "async") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    base_dir = root / "baseline"
    base = supervise(tiny_overrides(base_dir, data_dir, steps, interval, keep_last, async_mode), 0,
                     root / "baseline.log")
    result = {"baseline": {"run_dir": str(base_dir), "ok": base.succeeded}, "chains": []}
    baseline = step_losses(base_dir)
    for i, faults in enumerate(plan_chains(n_kills, n_chains, seed, steps, interval, keep_last)):
        run_dir = root / f"chain{i}"
        sup = supervise(tiny_overrides(run_dir, data_dir, steps, interval, keep_last, async_mode,
                                       [faults_override(faults)]), len(faults) + 1, root / f"chain{i}.log")
        attempts = [a.__dict__ for a in sup.attempts]
        problems = divergences(baseline, run_dir) + resume_problems(run_dir, attempts)
        fired = {m.name for m in (run_dir / "faults").glob("fired-*")}
        unfired = [f for i, f in enumerate(faults) if not any(n.startswith(f"fired-{i}-") for n in fired)]
        if not sup.succeeded:
            problems.append(f"did not finish: attempts {[a['returncode'] for a in attempts]}")
        # A kill at checkpoint_committed of step s is passed over by timing when a step kill ends the
        # attempt before the async commit of s is noticed (s is not committed again after the resume).
        missed = [f for f in unfired if f["phase"] != "checkpoint_committed"]
        if missed or len(unfired) > 1:
            problems.append(f"{len(faults) - len(unfired)} of {len(faults)} faults fired; never: {unfired}")
        result["chains"].append({"run_dir": str(run_dir), "faults": faults, "attempts": attempts,
                                 "kills": sup.kills, "problems": problems})
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Kill-point rehearsal at one layout (single process)")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kills", type=int, default=24)
    p.add_argument("--chains", type=int, default=6)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--async-mode", default="async")
    a = p.parse_args(argv)
    result = run_rehearsal(a.root, a.data.resolve(), a.kills, a.chains, a.seed, a.steps, a.interval,
                           async_mode=a.async_mode)
    a.out.write_text(json.dumps(result, indent=1))
    bad = [c for c in result["chains"] if c["problems"]]
    print(f"{sum(c['kills'] for c in result['chains'])} kills in {len(result['chains'])} chains; "
          f"{len(bad)} with problems")
    return 1 if bad or not result["baseline"]["ok"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
