"""Run by test_step_counts.py under torchrun: train.py as a user runs it, counting per step the
collectives the product issues (through parallel/collectives.py) and the host syncs.

A host sync is ``Tensor.item``, ``.tolist``, ``float(t)``, ``int(t)`` or ``bool(t)`` called by the
project's own code (torch's internals are its own choice per device: on CPU, AdamW reads its CPU
step counters with ``.item()``, which waits for no device) and outside the collectives module's
control helpers (those move CPU tensors on the control group by design). A step is counted from
one ``train_step`` call to the next, so it includes the loop's end-of-step work. Writes
{step: {"collectives": {name: n}, "syncs": {name: n}}} to OUT.json on rank 0.

  torchrun --nproc-per-node 2 tests/workers/step_counts.py OUT.json train.py OVERRIDE...
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch

from parallel import collectives

COLLECTIVES = ("all_reduce", "all_gather", "agree_max", "any_rank", "gather_floats", "broadcast_object",
               "all_gather_object", "agree_on_problems", "barrier", "decided_on_rank0", "send", "recv", "exchange")
CONTROL = {"agree_max", "any_rank", "gather_floats", "broadcast_object", "all_gather_object", "agree_on_problems",
           "barrier", "decided_on_rank0"}
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")

ROOT = str(Path(__file__).resolve().parents[2]) + "/"
steps: list = []
depth = {"collective": 0, "control": 0}


def _current():
    return steps[-1] if steps else None


def _wrap_collective(name, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        now = _current()
        if now is not None and depth["collective"] == 0:
            now["collectives"][name] += 1
        depth["collective"] += 1
        depth["control"] += name in CONTROL
        try:
            return fn(*args, **kwargs)
        finally:
            depth["collective"] -= 1
            depth["control"] -= name in CONTROL
    return counted


def _ours(filename: str) -> bool:
    return filename.startswith(ROOT) and "/.venv/" not in filename and "/site-packages/" not in filename


def _wrap_sync(name, fn):
    @functools.wraps(fn)
    def counted(self, *args, **kwargs):
        now = _current()
        if now is not None and depth["control"] == 0 and _ours(sys._getframe(1).f_code.co_filename):
            now["syncs"][name] += 1
        return fn(self, *args, **kwargs)
    return counted


def main() -> None:
    out, script, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for name in COLLECTIVES:
        setattr(collectives, name, _wrap_collective(name, getattr(collectives, name)))
    for name in SYNCS:
        setattr(torch.Tensor, name, _wrap_sync(name, getattr(torch.Tensor, name)))
    import trainer.run as run_module

    step_fn = run_module.train_step

    def train_step(*args, **kwargs):
        steps.append({"collectives": Counter(), "syncs": Counter()})
        return step_fn(*args, **kwargs)

    run_module.train_step = train_step
    sys.argv = [script, *overrides]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps({i + 1: {k: dict(v) for k, v in s.items()} for i, s in enumerate(steps)}))


if __name__ == "__main__":
    main()
