"""Every parallel layout trains exactly like one process (fp32, CPU, gloo, real torchrun).

tests/support/workers/parallel_worker.py trains the debug model for 10 steps (seeded synthetic batches,
grad accumulation where dp < 4) and dumps losses, grad norms and the gathered parameters;
each layout also turns on one option (activation checkpointing, loss parallel, deferred
gradient sync, no reshard after forward) that must not change the result.

Tolerances (fp32; only the order of floating-point reductions differs):
  initial parameters  bitwise equal (each rank computes only its shard of the single-process
                      init: model/init.py's values depend on seed, name and position only)
  loss per step       |diff| <= 1e-5   (measured <= 1e-6)
  grad norm per step  |diff| <= 1e-4   (measured <= 1e-5)
  final parameters    |diff| <= 1e-4   (measured <= 4e-5: Adam amplifies last-bit noise)
"""

from __future__ import annotations

import json

import pytest
import torch

from metrics.records import read_metrics
from model.config import ModelConfig
from parallel.dims import ParallelDims, check_tensor_parallel_fits, resolve_parallel_dims
from rehearsal.runs import debug_overrides
from support.launch import python_or_torchrun, run, run_train, worker

LOSS_ATOL, GRAD_NORM_ATOL, PARAM_ATOL = 1e-5, 1e-4, 1e-4

LAYOUTS = {
    "dp_shard2": (2, ["dp_shard=2", "grad_sync_every_micro_batch=false", "activation_checkpoint=full"]),
    "tp2": (2, ["tp=2", "loss_parallel=true"]),
    "dp_shard2_tp2": (4, ["dp_shard=2", "tp=2", "activation_checkpoint=selective", "check_timeout=true"]),
    "dp_replicate2_dp_shard2": (4, ["dp_replicate=2", "dp_shard=2", "reshard_after_forward=false"]),
    "dp_shard4": (4, ["dp_shard=4"]),
}


def _worker(out, nproc: int, args):
    cmd = python_or_torchrun(nproc, worker("parallel_worker"), str(out), *args)
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("ref") / "ref.pt", 1, [])


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, args = LAYOUTS[name]
    out = tmp_path / f"{name}.pt"
    got = _worker(out, nproc, args)
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    losses = torch.tensor(got["losses"], dtype=torch.float64)
    assert len(losses) == len(ref_losses) == 10
    assert ref_losses[-3:].mean() < ref_losses[0] - 0.5, "the reference run should learn"
    assert (losses - ref_losses).abs().max() <= LOSS_ATOL, (got["layout"], losses, ref_losses)
    norms = torch.tensor(got["grad_norms"], dtype=torch.float64)
    assert (norms - torch.tensor(reference["grad_norms"], dtype=torch.float64)).abs().max() <= GRAD_NORM_ATOL
    assert got["initial"].keys() == reference["initial"].keys()
    for key, ref in reference["initial"].items():
        assert torch.equal(got["initial"][key], ref), f"initial {key} differs under {got['layout']}"
    for key, ref in reference["final"].items():
        diff = (got["final"][key] - ref).abs().max().item()
        assert diff <= PARAM_ATOL, f"final {key} differs by {diff:.2e} under {got['layout']}"
    if "check_timeout=true" in args:
        # After set_collective_timeout(1.5 s) rank 3 stalls for 6 s: its dp partner (rank 1, on a
        # mesh sub-group) must fail with gloo's timeout; ranks 0 and 2 are unaffected.
        results = {r: json.loads((tmp_path / f"{name}.pt.timeout{r}.json").read_text()) for r in (0, 1, 2)}
        assert results[1]["raised"] and "Timed out" in results[1]["error"], results[1]
        assert results[1]["seconds"] < 5.5, "the tightened timeout, not the 600 s start-up one, fired"
        assert not results[0]["raised"] and not results[2]["raised"]
        assert results[1]["groups"] >= 3  # at least the default group, the dp group and the tp group


@pytest.mark.distributed
def test_train_py_on_real_data_matches_one_process(pydoc_data, tmp_path):
    """train.py itself under dp_shard=2 x tp=2: ranks of a tp group read the same slice."""
    single = tmp_path / "single"
    run_train(debug_overrides(single, pydoc_data, steps=6, extra={"training.micro_batch_size": 2}))
    layout = tmp_path / "dp2tp2"
    proc = run_train(debug_overrides(layout, pydoc_data, steps=6, extra={
        "training.micro_batch_size": 2, "parallel.dp_shard": 2, "parallel.tp": 2}), nproc=4)
    assert "world 4 = dp_replicate 1 x dp_shard 2 x tp 2" in proc.stderr
    a = [r["loss"] for r in read_metrics(single)]
    b = [r["loss"] for r in read_metrics(layout)]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) <= LOSS_ATOL, (a, b)


@pytest.mark.distributed  # starts train.py
def test_layout_that_does_not_fit_the_world_stops_at_start_up(pydoc_data, tmp_path):
    proc = run_train(debug_overrides(tmp_path / "bad", pydoc_data, steps=2, extra={"parallel.tp": 2}), check=False)
    assert proc.returncode != 0
    assert "world size 1 is not divisible by parallel.dp_replicate (1) x parallel.tp (2) = 2" in proc.stderr
    assert "Valid layouts: dp_replicate=1 dp_shard=1 tp=1" in proc.stderr


def test_resolve_dims_names_the_numbers_and_alternatives():
    dims = resolve_parallel_dims(2, -1, 2, 8)
    assert dims == ParallelDims(2, 2, 2, 8) and dims.dp == 4 and dims.hsdp_enabled and dims.fsdp_enabled
    with pytest.raises(ValueError) as err:
        resolve_parallel_dims(1, 3, 2, 8)
    msg = str(err.value)
    assert "parallel.dp_replicate=1 x parallel.dp_shard=3 x parallel.tp=2 = 6 ranks, but the world size is 8" in msg
    assert "dp_replicate=1 dp_shard=4 tp=2" in msg  # the nearest valid layout comes first
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve_parallel_dims(1, 0, 1, 1)


def test_tp_that_does_not_divide_the_heads_is_refused():
    debug = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)
    check_tensor_parallel_fits(debug, 2, 64)  # fine
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_fits(debug, 4, 64)
    assert "parallel.tp=4 does not divide model.n_kv_heads=2" in str(err.value)
    assert "tp degrees that divide all of them: [1, 2]" in str(err.value)
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_fits(debug, 3, 64)
    assert "model.n_heads=4" in str(err.value) and "training.seq_len (sequence parallel)=64" in str(err.value)


def test_options_that_cannot_apply_are_refused_with_the_fix():
    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.parallelize import parallelize_model

    one = ParallelDims(1, 1, 1, 1)
    for option, text in (("cpu_offload", "parallel.cpu_offload=true moves state between GPU and host memory"),
                         ("loss_parallel", "parallel.loss_parallel=true needs parallel.tp > 1 (tp=1)")):
        cfg = ParallelConfig(device="cpu", **{option: True})
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            parallelize_model(build_model(ModelConfig(), materialize=False), one, cfg, torch.device("cpu"), 64)
    with pytest.raises(ValueError, match="activation_checkpoint='some'"):
        parallelize_model(build_model(ModelConfig(), materialize=False), one,
                          ParallelConfig(device="cpu", activation_checkpoint="some"), torch.device("cpu"), 64)


@pytest.mark.distributed
def test_tp_collectives_per_block_are_what_the_planner_counts(tmp_path):
    """tp=2, sequence parallel, 2 blocks: the collectives one step issues, forward and backward, per
    activation-checkpointing mode. Selective checkpointing must not run the reduce-scatters again
    in backward (its save list keeps them; before, it recomputed one per block), and the totals are
    the planner's per-block counts (model/counting.py)."""
    from model.counting import TP_COLLECTIVES_OUTSIDE_BLOCKS, TP_COLLECTIVES_PER_BLOCK

    out = tmp_path / "counts.json"
    proc = run(python_or_torchrun(2, worker("sac_collectives"), str(out)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(out.read_text())
    rs = {mode: c["backward"].get("reduce_scatter_tensor", 0) for mode, c in counts.items()}
    assert rs["selective"] == rs["none"] < rs["full"], counts
    blocks = ModelConfig().n_layers
    for mode, c in counts.items():
        total = sum(n for phase in c.values() for op, n in phase.items()
                    if op in ("reduce_scatter_tensor", "all_gather_into_tensor"))
        logits = 1  # the worker computes the loss on gathered logits (no loss parallel)
        assert total == blocks * TP_COLLECTIVES_PER_BLOCK[mode] + TP_COLLECTIVES_OUTSIDE_BLOCKS + logits, (mode, c)
