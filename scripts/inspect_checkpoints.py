"""List the checkpoints of a run: step, tier, size, committed or not, verified or not.

  python scripts/inspect_checkpoints.py outputs/debug/checkpoints            # sizes and states
  python scripts/inspect_checkpoints.py outputs/debug/checkpoints --verify   # also checksums
  ... --keep-last 2 --keep-every 100 --keep-best 0   # tiers as retention would assign them
  python scripts/inspect_checkpoints.py s3://bucket/run/checkpoints --verify   # on object storage
"""

from __future__ import annotations

import argparse
import sys

from checkpoint.durable.discovery import Candidate, list_checkpoints, read_latest_pointer, retention_plan
from checkpoint.durable.manifest import CheckpointError, check_files
from checkpoint.storage import location


def _size(path) -> int:
    return sum(e.size for e in path.walk())


def rows(root, verify: bool, keep_last: int, keep_every: int, keep_best: int, best_metric: str):
    infos = list_checkpoints(root)
    good = [c for c in infos if c.committed and c.bad is None and not c.replaced]
    plan = retention_plan([Candidate(c.step, getattr(c.manifest, best_metric, None)) for c in good],
                          keep_last, keep_every, keep_best) if good else {}
    out = []
    for c in infos:
        if not c.committed:
            state, verified, tier = "uncommitted", "-", "-"
        else:
            state = "bad" if c.bad else "unreadable" if c.unreadable else "replaced" if c.replaced else "committed"
            tier = "-" if c.bad or c.replaced else ",".join(plan.get(c.step, [])) or "delete-next"
            verified = "-"
            if verify and c.manifest is None:
                verified = f"FAILED: {c.unreadable}"
            elif verify:
                try:
                    problems = check_files(c.path, c.manifest)
                except CheckpointError as exc:
                    problems = [str(exc)]
                verified = "ok" if not problems else "FAILED: " + "; ".join(problems)
        m = c.manifest
        out.append({"checkpoint_id": c.checkpoint_id, "step": c.step, "state": state, "tier": tier,
                    "size_mib": _size(c.path) / 2**20, "verified": verified,
                    "loss": m.loss if m else None, "probe_loss": m.probe_loss if m else None,
                    "world": m.world_size if m else None, "bad": c.bad})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=location, help="checkpoint.dir of a run (a folder or s3://bucket/prefix)")
    p.add_argument("--verify", action="store_true", help="check sizes and checksums against the manifests")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--keep-every", type=int, default=0)
    p.add_argument("--keep-best", type=int, default=0)
    p.add_argument("--best-metric", default="loss")
    a = p.parse_args()
    table = rows(a.root, a.verify, a.keep_last, a.keep_every, a.keep_best, a.best_metric)
    print(f"{a.root}  (latest -> {read_latest_pointer(a.root)})")
    print(f"{'checkpoint_id':<24}{'step':>8}  {'state':<12}{'tier':<18}{'size MiB':>10}  "
          f"{'loss':>8}  {'probe':>8}  {'world':>5}  verified")
    for r in table:
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        probe = f"{r['probe_loss']:.4f}" if r["probe_loss"] is not None else "-"
        print(f"{r['checkpoint_id']:<24}{r['step']:>8}  {r['state']:<12}{r['tier']:<18}{r['size_mib']:>10.1f}  "
              f"{loss:>8}  {probe:>8}  {str(r['world'] or '-'):>5}  {r['verified']}"
              + (f"  (bad: {r['bad']})" if r["bad"] else ""))
    if any(r["verified"].startswith("FAILED") for r in table):
        sys.exit(1)


if __name__ == "__main__":
    main()
