"""The planner's numbers for Llama 3 70B on 512 GPUs (dp_shard 64 x tp 8), by hand."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.launch import run


def _run(args):
    return run([sys.executable, *args], timeout=600)


def test_70b_plan_matches_hand_arithmetic():
    proc = _run(["scripts/plan.py", "+experiment=70b", "parallel.dp_shard=64", "parallel.tp=8",
                 "--host-copy-gbps", "20", "--storage-gbps", "100", "--json"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads(proc.stdout)
    dim, layers, vocab, ffn, kv_dim = 8192, 80, 128256, 28672, 8 * 128
    per_layer = dim * dim * 2 + dim * kv_dim * 2 + 3 * dim * ffn + 2 * dim  # wq, wo, wk, wv, w1-3, 2 norms
    total = 2 * vocab * dim + layers * per_layer + dim
    assert plan["params_total"] == total == 70_553_706_496
    # Matrices are split by tp=8, then FSDP2 splits dim 0 of each tp shard by 64. All divide
    # evenly except the vocabulary: 128256 / 8 = 16032 rows, ceil(16032 / 64) = 251 on rank 0.
    # Norm weights are replicated over tp and only split by dp_shard: 8192 / 64 = 128 each.
    block = (dim * dim * 2 + dim * kv_dim * 2 + 3 * dim * ffn) // 512 + 2 * 128
    per_rank = layers * block + 2 * 251 * dim + 128
    assert plan["params_per_rank"] == per_rank == 137_826_432
    assert plan["param_bytes_per_rank"] == 4 * per_rank  # fp32 master shard
    assert plan["grad_bytes_per_rank"] == 4 * per_rank
    assert plan["optimizer_bytes_per_rank"] == 8 * per_rank  # AdamW exp_avg + exp_avg_sq, fp32
    assert plan["checkpoint_bytes_per_rank"] == 12 * per_rank
    assert plan["checkpoint_bytes_total"] == 12 * total  # ~847 GB
    assert abs(plan["snapshot_s"] - 12 * per_rank / 20e9) < 1e-9  # ~0.083 s
    assert abs(plan["write_s"] - 12 * total / 100e9) < 1e-9  # ~8.5 s
    # Before the snapshot, the probe's forward: 4 x 8192 tokens at a third of the training FLOPs per
    # token, a tp shard of them per rank, at the default efficiency (the FSDP all-gather of the
    # weights, 63 x per_rank x 2 B over the NIC = 0.39 s, hides behind it), plus the TP collectives
    # of a forward: (4 per block + 2) x 4 sequences x 7/8 x 8192 x 8192 x 2 B over NVLink.
    probe_compute = 4 * 8192 * plan["model_flops_per_token"] / 3 / 8 / (989e12 * 0.37)
    probe_tp = (4 * 80 + 2) * 4 * 8192 * dim * 2 * 7 // 8 / 360e9
    assert abs(plan["probe_s"] - (probe_compute + probe_tp)) < 1e-9  # ~1.8 + 0.4 s
    assert abs(plan["blocking_s"] - (plan["probe_s"] + plan["snapshot_s"])) < 1e-12
    assert (plan["dp_shard"], plan["tp"], plan["world_size"]) == (64, 8, 512)
    # Communication per step and rank: 512 sequences / 64 dp ranks = 8 micro-batches of 1. FSDP2 over
    # 64 ranks, one per node (NIC, 45 GB/s): the recipe keeps parameters gathered from forward to
    # backward, so one bf16 all-gather of 63 shards per micro-batch and one fp32 reduce-scatter.
    micro, shards = 8, 63
    assert plan["reshard_after_forward"] is False and plan["comm_fsdp_link"] == "nic"
    assert plan["comm_fsdp_all_gather_bytes"] == micro * shards * per_rank * 2  # ~139 GB
    assert plan["comm_fsdp_reduce_scatter_bytes"] == micro * shards * per_rank * 4  # ~278 GB
    assert abs(plan["comm_fsdp_s"] - micro * shards * per_rank * 6 / 45e9) < 1e-9  # ~9.3 s
    # TP 8 inside a node (NVLink, 360 GB/s), sequence parallel: per block 2 all-gathers and 2
    # reduce-scatters of the bf16 activations (1 x 8192 x 8192) in forward, 4 in backward, and the
    # 2 all-gathers again where selective checkpointing recomputes; 4 around the embedding and output.
    tp_bytes = micro * (80 * 10 + 4) * (8192 * dim * 2) * 7 // 8
    assert plan["comm_tp_bytes"] == tp_bytes and plan["comm_tp_link"] == "nvlink"  # ~605 GB
    assert abs(plan["comm_tp_s"] - tp_bytes / 360e9) < 1e-9  # ~1.7 s, exposed
    # The recipe is compute-bound: the FSDP traffic hides behind the step's compute.
    assert plan["bound"] == "compute" and plan["comm_fsdp_s"] < plan["compute_s"], plan
    assert abs(plan["step_s"] - (plan["compute_s"] + plan["comm_tp_s"])) < 1e-9
    assert plan["fits"] and plan["total_bytes_per_rank"] <= 80 * 2**30


def test_resharding_after_forward_doubles_the_all_gathers_and_makes_the_70b_step_communication_bound():
    proc = _run(["scripts/plan.py", "+experiment=70b", "parallel.dp_shard=64", "parallel.tp=8",
                 "parallel.reshard_after_forward=true", "--json"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads(proc.stdout)
    assert plan["comm_fsdp_all_gather_bytes"] == plan["comm_fsdp_reduce_scatter_bytes"]  # bf16 twice, fp32 once
    assert plan["bound"] == "communication (FSDP)" and plan["comm_fsdp_s"] > plan["compute_s"], plan
    assert abs(plan["step_s"] - (plan["comm_fsdp_s"] + plan["comm_tp_s"])) < 1e-9  # compute hidden in FSDP's time


@pytest.mark.distributed  # starts train.py
def test_dry_run_prints_the_plan_and_refuses_a_tp_that_does_not_divide_the_heads():
    ok = _run(["train.py", "dry_run=true", "parallel.dp_shard=2", "parallel.tp=2"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "layout: dp_replicate=1 x dp_shard=2 x tp=2 = 4 ranks (model debug)" in ok.stdout
    assert "checkpoint:" in ok.stdout and "blocking" in ok.stdout and "probe forward" in ok.stdout
    bad = _run(["scripts/plan.py", "parallel.dp_shard=1", "parallel.tp=8"])
    assert bad.returncode == 2
    assert "parallel.tp=8 does not divide model.n_heads=4, model.n_kv_heads=2" in bad.stderr
    assert "tp degrees that divide all of them: [1, 2]" in bad.stderr
