"""scripts/plan.py's activation term, verdict and step-time estimate for Llama 3 70B on 512 GPUs, by hand.

The activation formula itself is checked against measured saved-tensor bytes in
tests/unit/test_activation_memory.py; here the planner must apply it to the layout and config.
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from model.config import ModelConfig
from model.counting import recompute_flops_per_token
from planner.plan import DEFAULT_COMPUTE_EFFICIENCY, GIB
from support.launch import ROOT, load_script

LAYOUT = ["+experiment=70b", "parallel.dp_shard=64", "parallel.tp=8"]
D, S, F, KV, H, TP = 8192, 8192, 28672, 1024, 64, 8


@pytest.fixture
def plan(capsys):
    """scripts/plan.py's main in this process (it builds its own fake process group)."""
    script = load_script("plan")

    def call(*args):
        assert script.main([*LAYOUT, *args]) == 0
        return capsys.readouterr().out

    return call


def test_70b_defaults_fit_80_gib_with_selective_checkpointing_and_loss_parallel(plan):
    p = json.loads(plan("--json"))
    assert (p["activation_checkpoint"], p["loss_parallel"], p["micro_batch"], p["seq_len"]) == ("selective", True, 1, S)
    # bf16 (2 B); per block: input (s/tp x d), wq/wk/wv outputs, wo and w2 outputs (full-sequence
    # partial sums) and their reduce-scatters (s/tp x d), w1/w3 outputs, SDPA output, log-sum-exp (fp32)
    block = 2 * (S // TP * D + S * (D + 2 * KV) // TP + 2 * S * D + 2 * S // TP * D + 2 * S * F // TP
                 + S * D // TP) + 4 * H // TP * S
    assert p["activation_per_block_bytes"] == block == 474_218_496
    assert p["fits"] and p["total_bytes_per_rank"] <= 80 * GIB
    assert p["total_bytes_per_rank"] == (p["state_bytes_per_rank"] + p["activation_bytes_per_rank"]
                                         + p["fsdp_buffer_bytes"] + 4 * GIB)
    tokens_per_rank = 512 * S / 512
    compute_s = p["model_flops_per_token"] * tokens_per_rank / (989e12 * DEFAULT_COMPUTE_EFFICIENCY)
    assert abs(p["compute_s"] - compute_s) < 1e-9  # nothing recomputed under selective checkpointing
    assert abs(p["step_s"] - (compute_s + p["comm_tp_s"])) < 1e-9  # compute-bound: FSDP hidden
    assert abs(p["mfu"] - p["model_flops_per_token"] * tokens_per_rank / (p["step_s"] * 989e12)) < 1e-12
    text = plan()
    assert "activation checkpointing selective, loss parallel" in text
    assert "of 80 GiB: fits" in text and "step time (estimate):" in text


def test_verdict_and_step_time_follow_the_layout_and_device(plan):
    none = json.loads(plan("parallel.activation_checkpoint=none", "parallel.loss_parallel=false",
                           "--device-memory-gib", "70", "--json"))
    assert not none["fits"] and none["total_bytes_per_rank"] > 70 * GIB
    assert "of 70 GiB: does NOT fit" in plan("parallel.activation_checkpoint=none", "parallel.loss_parallel=false",
                                             "--device-memory-gib", "70")
    full = json.loads(plan("parallel.activation_checkpoint=full", "--device-tflops", "500", "--json"))
    assert full["fits"] and full["activation_per_block_bytes"] == 2 * S // TP * D
    model = full["model_flops_per_token"]
    mcfg = ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / "70b.yaml")))
    extra = recompute_flops_per_token(mcfg, S, "full")
    assert extra == 80 * (2 * (2 * D * D + 2 * D * KV + 3 * D * F) + 4 * D * S)
    compute_s = (model + extra) * S / (500e12 * DEFAULT_COMPUTE_EFFICIENCY)
    assert abs(full["compute_s"] - compute_s) < 1e-9
    assert abs(full["mfu"] - model * S / (full["step_s"] * 500e12)) < 1e-12
    assert full["mfu"] < DEFAULT_COMPUTE_EFFICIENCY * model / (model + extra)  # the TP time shows

