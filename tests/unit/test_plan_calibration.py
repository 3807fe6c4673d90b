"""The planner's step time against published throughput (a calibration, not a proof).

torchtitan's Llama 3.1 benchmarks on H100 (``benchmarks/llama3_h100_202412_torchtitan.md`` in the
torchtitan repository, December 2024; 96 GB HBM2e H100s at 500 W, NVLink inside a host, 400 Gb/s
RDMA per GPU between hosts; sequence length 8192, bf16 with fp32 gradient reduction): tokens/s
per GPU for each layout below. The planner must land within 25% of each with its defaults: one
achievable fraction of the peak (``DEFAULT_COMPUTE_EFFICIENCY``), the compile gain of the same
table, and the H100 system's bandwidths. The 70B run also used float8 linears, which this trainer
does not have: its case multiplies the efficiency by the float8 gain of the same table (8,532 /
6,667 tokens/s at 8B), as published. It passes only with that gain (-17.5%); without it the planner
says 558 tokens/s, -32.7%: the 70B point checks the planner only up to a float8 gain measured at 8B.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from omegaconf import OmegaConf

from model.config import ModelConfig
from parallel.dims import resolve_parallel_dims
from planner.plan import DEFAULT_COMPUTE_EFFICIENCY, Device, Workload, plan_layout
from support.launch import ROOT

FLOAT8_GAIN = 8532 / 6667  # torchtitan Table 1: 8B, 8 GPUs, FSDP + compile with and without float8
TOLERANCE = 0.25

# (model, dp_shard, tp, global batch, local batch, activation checkpointing, compile, float8, tokens/s/GPU)
PUBLISHED = {
    "8b-8gpu-fsdp": ("8b", 8, 1, 16, 2, "selective", False, False, 5762),  # Table 1
    "8b-8gpu-fsdp-compile": ("8b", 8, 1, 16, 2, "selective", True, False, 6667),  # Table 1
    "8b-128gpu-fsdp": ("8b", 128, 1, 256, 2, "selective", False, False, 5605),  # Table 3
    "8b-128gpu-fsdp-compile": ("8b", 128, 1, 256, 2, "selective", True, False, 6514),  # Table 3
    "70b-256gpu-fsdp32-tp8": ("70b", 32, 8, 512, 16, "full", True, True, 829),  # Table 4 (2D, no async TP)
}


@lru_cache(maxsize=None)
def _model(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")))


@pytest.mark.parametrize("case", list(PUBLISHED))
def test_the_planner_is_within_25_percent_of_torchtitans_published_throughput(case):
    name, dp_shard, tp, global_batch, local_batch, ac, compiled, float8, published = PUBLISHED[case]
    world = dp_shard * tp
    workload = Workload(seq_len=8192, micro_batch=local_batch, global_batch=global_batch, activation_checkpoint=ac,
                        loss_parallel=tp > 1, mixed_precision="bf16", param_dtype="bf16", reduce_dtype="fp32",
                        compile=compiled)
    device = Device(efficiency=DEFAULT_COMPUTE_EFFICIENCY * (FLOAT8_GAIN if float8 else 1.0))
    plan = plan_layout(_model(name), resolve_parallel_dims(1, dp_shard, tp, world), 8192, workload=workload,
                       device=device)
    assert plan.comm.fsdp_link == ("nvlink" if world <= 8 else "nic")
    estimate = plan.tokens_per_s_per_device
    assert abs(estimate / published - 1) <= TOLERANCE, (case, round(estimate), published, plan.step)
