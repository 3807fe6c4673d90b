"""Run by test_step_counts.py under torchrun: train.py as a user runs it, counting per step the
collectives the product issues (through parallel/collectives.py), the functional collectives
(DTensor's, at torch.ops._c10d_functional, which every redistribute and funcol call goes through)
issued outside the model's forward, its loss and the backward (there they are TP's own), and the
host syncs.

A host sync is ``Tensor.item``, ``.tolist``, ``float(t)``, ``int(t)`` or ``bool(t)`` called by the
project's own code (torch's internals are its own choice per device: on CPU, AdamW reads its CPU
step counters with ``.item()``, which waits for no device) and outside the collectives module's
control helpers (those move CPU tensors on the control group by design). The garbage collector's
runs are counted too, by generation (``gc.callbacks``). A step is counted from one ``train_step``
call to the next, so it includes the loop's end-of-step work. Writes {step: {"collectives": {name: n},
"functional": {op: n}, "tp_own": {op: n}, "syncs": {name: n}, "gc": {generation: n}}} to OUT.json on
rank 0 (``functional``: outside the model, ``tp_own``: inside it, for the record).

  torchrun --nproc-per-node 2 tests/support/workers/step_counts.py OUT.json train.py OVERRIDE...
"""

from __future__ import annotations

import functools
import gc
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops

from parallel import collectives

COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "agree_max", "any_rank", "gather_floats",
               "broadcast_object", "all_gather_object", "agree_on_problems", "barrier", "decided_on_rank0", "send",
               "recv", "exchange")
CONTROL = {"agree_max", "any_rank", "gather_floats", "broadcast_object", "all_gather_object", "agree_on_problems",
           "barrier", "decided_on_rank0"}
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")
FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
              "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")

ROOT = str(Path(__file__).resolve().parents[3]) + "/"
steps: list = []
depth = {"collective": 0, "control": 0, "model": 0}


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


class _CountedOp:
    """Stands in for one torch.ops._c10d_functional op: counts each call, forwards everything else."""

    def __init__(self, name, packet):
        self.name, self.packet = name, packet

    def __call__(self, *args, **kwargs):
        now = _current()
        if now is not None and depth["collective"] == 0:
            now["tp_own" if depth["model"] else "functional"][self.name] += 1
        return self.packet(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.packet, attr)


def _in_model(fn):
    """``fn`` (the model's forward, the loss, a backward) runs inside the model: TP's own collectives."""
    @functools.wraps(fn)
    def inside(*args, **kwargs):
        depth["model"] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth["model"] -= 1
    return inside


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


def _count_gc(phase, info):
    now = _current()
    if now is not None and phase == "start":
        now["gc"][str(info["generation"])] += 1


def main() -> None:
    out, script, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    gc.callbacks.append(_count_gc)
    for name in COLLECTIVES:
        setattr(collectives, name, _wrap_collective(name, getattr(collectives, name)))
    for name in SYNCS:
        setattr(torch.Tensor, name, _wrap_sync(name, getattr(torch.Tensor, name)))
    for name in FUNCTIONAL:
        setattr(torch.ops._c10d_functional, name, _CountedOp(name, getattr(torch.ops._c10d_functional, name)))
    import model.llama
    import trainer.run as run_module
    import training.evaluate
    import training.step

    model.llama.Transformer.forward = _in_model(model.llama.Transformer.forward)
    torch.Tensor.backward = _in_model(torch.Tensor.backward)
    for module in (training.step, training.evaluate):  # the probe's loss is training.evaluate's
        module.token_loss_sum = _in_model(module.token_loss_sum)
    step_fn = run_module.train_step

    def train_step(*args, **kwargs):
        steps.append({"collectives": Counter(), "functional": Counter(), "tp_own": Counter(), "syncs": Counter(),
                      "gc": Counter()})
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
