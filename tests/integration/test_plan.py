"""The planner's numbers for Llama 3 70B on 512 GPUs (dp_shard 64 x tp 8), by hand; the communication
terms of other layouts (HSDP, resharding) by hand, in this process; scripts/plan.py's system and bandwidth
options change the terms they name."""

from __future__ import annotations

import json
import sys

import pytest

from model.config import ModelConfig
from parallel.dims import ParallelDims
from planner.comm_model import SYSTEMS, Recipe, communication
from support.launch import load_script, run


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
    assert plan["checkpoint_bytes_total"] == 12 * total  # ~847 GB (788.5 GiB)
    assert abs(plan["snapshot_s"] - 12 * per_rank / 20e9) < 1e-9  # ~0.083 s
    # Host memory an async save stages into, per node of 8 GPUs: each rank's state once, pinned by registration
    # (checkpoint/durable/staging.py: no power-of-two rounding), in /dev/shm with async_process: ~13.2 GB
    assert plan["host_staging_bytes_per_node"] == 8 * 12 * per_rank
    assert abs(plan["write_s"] - 12 * total / 100e9) < 1e-9  # ~8.5 s
    # Before the snapshot, the probe's forward: 4 x 8192 tokens at a third of the training FLOPs per
    # token, a tp shard of them per rank, at the default efficiency (the FSDP all-gather of the
    # weights, 63 x per_rank x 2 B over the NIC = 0.39 s, hides behind it), plus the TP collectives
    # of a forward: (4 per block + 2) x 4 sequences x 7/8 x 8192 x 8192 x 2 B over NVLink.
    probe_compute = 4 * 8192 * plan["model_flops_per_token"] / 3 / 8 / (989e12 * 0.37)
    probe_tp = (4 * 80 + 2) * 4 * 8192 * dim * 2 * 7 // 8 / 360e9
    assert abs(plan["probe_s"] - (probe_compute + probe_tp)) < 1e-9  # ~1.8 + 0.4 s
    assert abs(plan["blocking_s"] - (plan["probe_s"] + plan["snapshot_s"])) < 1e-12
    # scripts/plan_checkpointing.py's save cost is this one (its state spread evenly: rank 0's shard is a
    # little larger here), so the runbook's tables count the probe as this plan does
    checkpointing = load_script("plan_checkpointing")
    save = checkpointing.save("70b", 512, 100.0, checkpointing.parser().parse_args(["--host-copy-gbps", "20"]))
    assert save.probe_s == plan["probe_s"] and save.write_s == plan["write_s"]
    assert save.snapshot_s == pytest.approx(plan["snapshot_s"], rel=1e-3)
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
    assert plan["comm_tp_bytes"] == tp_bytes and plan["comm_tp_link"] == "nvlink"  # ~755.4 GB
    assert abs(plan["comm_tp_s"] - tp_bytes / 360e9) < 1e-9  # ~2.10 s, exposed
    # The recipe is compute-bound: the FSDP traffic hides behind the step's compute.
    assert plan["bound"] == "compute" and plan["comm_fsdp_s"] < plan["compute_s"], plan
    assert abs(plan["step_s"] - (plan["compute_s"] + plan["comm_tp_s"])) < 1e-9
    assert plan["fits"] and plan["total_bytes_per_rank"] <= 80 * 2**30
    # Its margin: compute scales with 1 / efficiency, the FSDP time with 1 / NIC bandwidth (~16%: flips at an
    # achievable fraction of ~0.43 or a NIC of ~38.7 GB/s).
    assert abs(plan["margin_spare"] - (plan["compute_s"] / plan["comm_fsdp_s"] - 1)) < 1e-12
    assert abs(plan["margin_efficiency"] - 0.37 * plan["compute_s"] / plan["comm_fsdp_s"]) < 1e-12
    assert abs(plan["margin_nic_gbps"] - 45 * plan["comm_fsdp_s"] / plan["compute_s"]) < 1e-9


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


# --- communication terms by hand, in this process ---------------------------------------------------------
DEBUG = ModelConfig()  # dim 128, 2 layers, vocabulary 320: only the TP term reads the shape
SHARD = 1_000_003  # a rank's parameters (odd, so an integer division shows)


def _comm(dims, **recipe):
    return communication(DEBUG, dims, SHARD, Recipe(**{"micro_batch": 1, "grad_accum": 4, "seq_len": 64, **recipe}),
                         SYSTEMS["h100"])


def test_hsdp_all_reduces_the_shards_across_replicas_once_per_step():
    """HSDP 4 replicas x dp_shard 8 x tp 2 = 64 ranks, 4 micro-batches, fp32 reduction: the reduce-scatter inside
    a replica runs per micro-batch, the all-reduce across replicas once (the trainer defers it to the last one)."""
    c = _comm(ParallelDims(4, 8, 2, 64))
    assert c.hsdp_all_reduce_bytes == 2 * 3 * SHARD * 4 // 4  # 2 (r-1)/r x the fp32 shard, once
    assert c.fsdp_reduce_scatter_bytes == 4 * 7 * SHARD * 4  # per micro-batch, (n-1) shards
    assert c.fsdp_all_gather_bytes == 4 * 2 * 7 * SHARD * 4  # fp32 parameters, twice per micro-batch
    # dp_shard x tp = 16 ranks span two nodes of 8: FSDP on the NIC; the replicas span the world: NIC
    assert (c.fsdp_link, c.hsdp_link, c.tp_link) == ("nic", "nic", "nvlink")
    volume = c.fsdp_all_gather_bytes + c.fsdp_reduce_scatter_bytes + c.hsdp_all_reduce_bytes
    assert c.fsdp_s == pytest.approx(volume / 45e9, rel=1e-12)
    # bf16 reduction halves both the reduce-scatter and the all-reduce; once per step without per-micro sync
    half = _comm(ParallelDims(4, 8, 2, 64), reduce_dtype="bf16", grad_sync_every_micro_batch=False)
    assert half.hsdp_all_reduce_bytes == 2 * 3 * SHARD * 2 // 4
    assert half.fsdp_reduce_scatter_bytes == 7 * SHARD * 2
    # inside one node (2 x 2 x 2 = 8 ranks) every group is on NVLink
    assert {_comm(ParallelDims(2, 2, 2, 8)).hsdp_link, _comm(ParallelDims(2, 2, 2, 8)).fsdp_link} == {"nvlink"}
    assert _comm(ParallelDims(1, 8, 2, 16)).hsdp_all_reduce_bytes == 0  # no replicas, no all-reduce


def test_resharding_after_forward_gathers_twice_per_micro_batch():
    gathered, resharded = (_comm(ParallelDims(1, 16, 1, 16), param_dtype="bf16", reshard_after_forward=r)
                           for r in (False, True))
    assert gathered.fsdp_all_gather_bytes == 4 * 1 * 15 * SHARD * 2  # forward only: kept until the backward
    assert resharded.fsdp_all_gather_bytes == 4 * 2 * 15 * SHARD * 2  # forward, and again before the backward
    assert gathered.fsdp_reduce_scatter_bytes == resharded.fsdp_reduce_scatter_bytes == 4 * 15 * SHARD * 4
    assert resharded.fsdp_s - gathered.fsdp_s == pytest.approx(4 * 15 * SHARD * 2 / 45e9, rel=1e-9)
    assert gathered.tp_bytes == resharded.tp_bytes == 0  # tp 1


def _plan_json(capsys, *argv) -> dict:
    """scripts/plan.py in this process: the debug model on 16 ranks (dp_shard 8 x tp 2: FSDP spans two nodes of
    8, TP stays in one), on a fake process group."""
    assert load_script("plan").main(["parallel.dp_shard=8", "parallel.tp=2", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_system_and_bandwidth_options_change_the_terms_they_name(capsys):
    base = _plan_json(capsys)
    assert (base["comm_fsdp_link"], base["comm_tp_link"], base["device_memory_gib"]) == ("nic", "nvlink", 80.0)
    assert base["comm_fsdp_s"] > 0 and base["comm_tp_s"] > 0
    nic = _plan_json(capsys, "--nic-gbps", "90")  # FSDP's link twice as fast: half its time; TP untouched
    assert nic["comm_fsdp_s"] == pytest.approx(base["comm_fsdp_s"] / 2, rel=1e-12)
    assert nic["comm_tp_s"] == base["comm_tp_s"]
    assert nic["comm_fsdp_all_gather_bytes"] == base["comm_fsdp_all_gather_bytes"]
    nvlink = _plan_json(capsys, "--nvlink-gbps", "720")  # TP's link twice as fast; FSDP untouched
    assert nvlink["comm_tp_s"] == pytest.approx(base["comm_tp_s"] / 2, rel=1e-12)
    assert nvlink["comm_fsdp_s"] == base["comm_fsdp_s"]
    node16 = _plan_json(capsys, "--gpus-per-node", "16")  # the FSDP group now fits one node: NVLink
    assert node16["comm_fsdp_link"] == "nvlink"
    assert node16["comm_fsdp_s"] == pytest.approx(base["comm_fsdp_s"] * 45 / 360, rel=1e-12)
    h200 = _plan_json(capsys, "--system", "h200")  # more memory, the same peak and links
    assert h200["device_memory_gib"] == pytest.approx(143771 / 1024) and h200["step_s"] == base["step_s"]
    assert h200["total_bytes_per_rank"] == base["total_bytes_per_rank"]
    same = {k: base[k] for k in base if k.startswith("comm_")}
    assert {k: h200[k] for k in same} == same
    mixed = _plan_json(capsys, "--system", "h200", "--nic-gbps", "90")  # an option wins over its system's number
    assert mixed["comm_fsdp_s"] == nic["comm_fsdp_s"] and mixed["device_memory_gib"] == h200["device_memory_gib"]


def test_the_margin_names_where_the_bound_flips(capsys):
    """Plan again just either side of the achievable fraction and the NIC bandwidth the margin names: the bound
    flips between them (compute scales with 1 / efficiency, the FSDP time with 1 / bandwidth)."""
    base = _plan_json(capsys)
    for option, value in (("--compute-efficiency", base["margin_efficiency"]), ("--nic-gbps", base["margin_nic_gbps"])):
        assert 0 < value < 1 or option == "--nic-gbps", base  # a flip point inside the option's range
        bounds = {_plan_json(capsys, option, f"{value * f}")["bound"] for f in (0.99, 1.01)}
        assert bounds == {"compute", "communication (FSDP)"}, (option, value)
