"""What one training step costs in synchronisation: at most one host sync and one collective of
the product's own per step (FSDP's and TP's aside), counted on real 2-rank runs of the debug
experiment as a user runs it (guards on), with the shadow check brought forward so that its steps
are counted too. The counting worker is tests/support/workers/step_counts.py.

The one collective after backward carries the loss, every layer's gradient norm (the guards and the
clipping norm read it: training/grad_stats.py) and the flags every rank must agree on (preemption, a
failed save, the automatic intervals; they had a gloo all-reduce of their own at the step's end
before); the host reads it once. The global token count comes from the data pipeline, not a
collective. A shadow step adds the probe's forward, one host read of its loss and one agreement on
its verdict.

At tp=2 without FSDP2 the norm weights' gradients arrive as partial sums over the tp ranks: TP's
own gradient sum adds one all-reduce for all of them (``all_reduce_coalesced``; one DTensor
redistribute per tensor before, 2 x layers + 1). Functional collectives (DTensor's) are counted
too: none may run outside the model's forward, its loss and the backward.

Python's garbage collector runs on a schedule (training.gc_interval), the same steps on every rank:
one generation-1 collection at each multiple of the interval and none anywhere else.
"""

from __future__ import annotations

import json

import pytest

from metrics.records import read_metrics
from support.launch import run, torchrun, worker

pytestmark = pytest.mark.distributed
GC_INTERVAL = 4

LAYOUTS = {  # name: (overrides, steps, shadow interval)
    # the default layout (FSDP2 over 2 ranks), long enough to pass every warm-up (the LR's and the guards' 20 steps)
    "fsdp": ([], 30, 25),
    "tp2": (["parallel.dp_shard=1", "parallel.tp=2", "parallel.loss_parallel=true", "optim.warmup_steps=2"], 12, 5),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_syncs_once_issues_one_collective_and_collects_garbage_on_schedule(tmp_path, pydoc_data, layout):
    extra, steps, shadow = LAYOUTS[layout]
    out, run_dir = tmp_path / "counts.json", tmp_path / "run"
    proc = run(torchrun(2, worker("step_counts"), str(out), "train.py", "+experiment=debug",
                        f"output_root={tmp_path}", f"run_name={run_dir.name}", f"data.path={pydoc_data}",
                        "data.prepare_if_missing=false", f"training.steps={steps}",
                        f"recovery.guards.shadow_interval={shadow}", f"training.gc_interval={GC_INTERVAL}", *extra),
               timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert sorted(counts) == list(range(1, steps + 1))
    busy = {e["step"] for kind in ("checkpoint", "eval") for e in read_metrics(run_dir, kind)}
    assert busy == {steps}  # the final evaluation and save: not a plain step
    tp_sums = 1 if layout == "tp2" else 0  # TP's own gradient sum, one all-reduce
    shadow_steps = {s for s in counts if s % shadow == 0 and s not in busy}
    assert shadow_steps
    for step, c in counts.items():
        if step < steps:  # the last step's count runs on past the loop's end, where automatic collection is back
            assert c["gc"] == ({"1": 1} if step % GC_INTERVAL == 0 else {}), (step, c["gc"])
        if step in busy:
            continue
        ours = dict(c["collectives"])
        assert ours.pop("all_reduce_coalesced", 0) == tp_sums, (step, c)
        assert c["functional"] == {}, (step, c)  # no DTensor collective outside the model
        on_shadow = step in shadow_steps
        assert sum(ours.values()) <= 1 + on_shadow, (step, c)
        assert sum(c["syncs"].values()) <= 1 + on_shadow, (step, c)
        if on_shadow:  # the probe's loss read once, its verdict agreed once
            assert ours == {"all_reduce": 1, "agree_max": 1} and c["syncs"] == {"tolist": 1, "__float__": 1}, (step, c)
    first = {"all_reduce": 1, **({"all_reduce_coalesced": 1} if tp_sums else {})}
    assert counts[1]["collectives"] == first, counts[1]
    assert counts[1]["syncs"] == {"tolist": 1}, counts[1]
    if layout == "tp2":  # the counter does see DTensor's collectives: TP's own, in the model
        assert sum(counts[1]["tp_own"].values()) > 0, counts[1]
