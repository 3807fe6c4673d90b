"""Tied embeddings (the `1b` preset, Llama 3.2) under FSDP2 and tensor parallel (real torchrun, gloo, CPU).

The embedding and the output layer share one parameter: under TP both shard it by
vocabulary rows (Shard(0)), under FSDP2 it lives in one unit with the final norm and the
output layer. Each layout trains exactly like one process (tests/support/workers/parallel_worker.py,
the same tolerances as tests/integration/test_parallel.py), and checkpoints keep the tie: a run saved at
dp_shard=2 resumes at tp=2, and the export writes one tensor under both names.
"""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from model.config import ModelConfig
from model.llama import build_model
from support.launch import ROOT, python_or_torchrun, worker
from support.launch import run as run_command
from support.resume import per_step, resumed_step, run

pytestmark = pytest.mark.distributed

TIED = "model.tie_embeddings=true"
LOSS_ATOL, GRAD_NORM_ATOL, PARAM_ATOL = 1e-5, 1e-4, 1e-4
LAYOUTS = {"dp_shard2": (2, ["dp_shard=2"]), "tp2": (2, ["tp=2"]), "dp_shard2_tp2": (4, ["dp_shard=2", "tp=2"])}


def _worker(out, nproc, args):
    cmd = python_or_torchrun(nproc, worker("parallel_worker"), str(out), TIED, *args)
    proc = run_command(cmd, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("tied") / "ref.pt", 1, [])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tied_model_matches_one_process(name, reference, tmp_path):
    nproc, args = LAYOUTS[name]
    got = _worker(tmp_path / f"{name}.pt", nproc, args)
    assert reference["tied"] and got["tied"], "output.weight must stay the embedding's parameter"
    untied = len(list(build_model(ModelConfig(), materialize=False).parameters()))
    assert reference["n_params"] == got["n_params"] == untied - 1
    assert "output.weight" not in got["initial"]  # one parameter, named once
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    losses = torch.tensor(got["losses"], dtype=torch.float64)
    assert ref_losses[-3:].mean() < ref_losses[0] - 0.5, "the reference run should learn"
    assert (losses - ref_losses).abs().max() <= LOSS_ATOL, (got["layout"], losses, ref_losses)
    norms = torch.tensor(got["grad_norms"], dtype=torch.float64)
    assert (norms - torch.tensor(reference["grad_norms"], dtype=torch.float64)).abs().max() <= GRAD_NORM_ATOL
    for key, ref in reference["initial"].items():
        assert torch.equal(got["initial"][key], ref), f"initial {key} differs under {got['layout']}"
    for key, ref in reference["final"].items():
        diff = (got["final"][key] - ref).abs().max().item()
        assert diff <= PARAM_ATOL, f"final {key} differs by {diff:.2e} under {got['layout']}"


def test_tied_checkpoint_reshards_and_exports_with_the_tie(pydoc_data, tmp_path):
    """train.py with tied embeddings: saved at dp_shard=2, resumed at tp=2 (DCP reshards the one
    tensor); steps 7..9 match the uninterrupted run; the export holds both names, equal, and
    loads into a tied model that gives the same logits as the embedding-only weights."""
    extra = {"model.tie_embeddings": "true", "training.micro_batch_size": 2}
    saved = tmp_path / "dp_shard2"
    run(saved, pydoc_data, extra={**extra, "parallel.dp_shard": 2}, nproc=2)
    resumed = tmp_path / "tp2"
    run(resumed, pydoc_data, nproc=2, extra={**extra, "parallel.tp": 2, "parallel.dp_shard": 1,
                                             "checkpoint.resume": str(saved / "checkpoints" / "step_00000006")})
    assert resumed_step(resumed) == 6
    got, ref = per_step(resumed), per_step(saved)
    for step in (7, 8, 9):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * ref[step]["loss"], (step, got[step], ref[step])

    out = tmp_path / "tied.safetensors"
    proc = run_command([sys.executable, str(ROOT / "scripts" / "export.py"),
                        str(resumed / "checkpoints" / "step_00000009"), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = load_file(out)
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
    debug = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / "debug.yaml"))
    model = build_model(ModelConfig(**{**debug, "tie_embeddings": True}), seed=0)
    model.load_state_dict(weights, strict=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, weights["output.weight"])
