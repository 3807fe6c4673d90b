"""Memory and checkpoint arithmetic for a model under a parallel layout, without hardware.

The model is built on the meta device and parallelised exactly as in training (the same
parallelize_model) on a fake process group of the target world size, so shard sizes come
from the real tensor-parallel plan and FSDP2 sharding, uneven shards included; then bytes
follow from bytes per element:

  parameters  fp32 master shard          4 B/param (FSDP2 keeps the sharded params in fp32)
  gradients   fp32 shard                 4 B/param
  optimizer   AdamW exp_avg + exp_avg_sq 8 B/param
  checkpoint  parameters + optimizer    12 B/param (gradients are not saved)

"Per rank" is rank 0, which holds the largest shard (torch.chunk gives the remainder to
the first ranks). The checkpoint total counts each element once: DCP writes a replicated
tensor (norm weights across tp, everything across dp_replicate) from one rank only.
Snapshot time is the per-rank state over the host-copy bandwidth of one rank (ranks copy in
parallel); write time is the total over the storage system's aggregate bandwidth.

Activations (model/activation_memory.py, one micro-batch: seq_len, tp with sequence
parallel, activation checkpointing, loss parallel) are what autograd keeps plus the larger
backward transient; FSDP2 adds two gathered units in param_dtype (the current and the
prefetched one) and one unit's unsharded gradients in reduce_dtype; a fixed reserve stands
for the CUDA context, NCCL buffers and allocator fragmentation. The verdict compares the sum
with --device-memory-gib. The step time is the step's FLOPs (model FLOPs of model/counting.py
plus the forward recomputed under full checkpointing) at an achievable fraction of the peak
(calibrated against published torchtitan throughput, docs/parallelism.md), plus the
communication that cannot hide behind them (planner/comm_model.py: FSDP2, HSDP and TP volumes
over NVLink or the NIC); MFU is model FLOPs over that time and the peak. An estimate, not a
measurement.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from model.activation_memory import ActivationMemory, activation_memory
from model.config import ModelConfig
from model.counting import count_params, flops_per_token, recompute_flops_per_token
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import ParallelDims, check_tensor_parallel_fits, resolve_parallel_dims
from parallel.parallelize import parallelize_model
from planner.comm_model import (
    DEFAULT_SYSTEM,
    DTYPE_BYTES,
    SYSTEMS,
    Communication,
    Recipe,
    StepTime,
    System,
    communication,
    probe_seconds,
)
from recovery.interval import DEFAULT_DEVICE_MTBF_HOURS, cluster_mtbf_s, young_daly_interval_s
from recovery.probe import PROBE_SEQUENCES

FP32_BYTES = 4
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
DEFAULT_HOST_COPY_GBPS = 25.0  # device-to-host per rank (PCIe 5 x16 ~ 25-50 GB/s in practice)
DEFAULT_STORAGE_GBPS = 50.0  # aggregate write bandwidth of the checkpoint file system
GB = 1e9
GIB = 2**30
DEFAULT_DEVICE_MEMORY_GIB = SYSTEMS[DEFAULT_SYSTEM].memory_gib  # H100 80 GB
DEFAULT_DEVICE_TFLOPS = SYSTEMS[DEFAULT_SYSTEM].peak_tflops  # H100 SXM dense bf16 peak
# Fraction of the peak a step's FLOPs run at in eager mode, and the gain of torch.compile: fitted
# to torchtitan's published Llama 3.1 8B / 70B throughput on H100 (docs/parallelism.md,
# tests/unit/test_plan_calibration.py; the 70B case only with float8's gain applied).
DEFAULT_COMPUTE_EFFICIENCY = 0.37
COMPILE_SPEEDUP = 6667 / 5762  # torchtitan's 8B on 8 H100s, FSDP with and without compile
DEFAULT_RESERVE_GIB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation (assumed)


@dataclass(frozen=True)
class Workload:
    """What one step runs on each rank (from the training and parallel config)."""
    seq_len: int = 2048
    micro_batch: int = 1
    global_batch: int = 1
    activation_checkpoint: str = "none"
    loss_parallel: bool = False
    mixed_precision: str = "fp32"
    param_dtype: str = "fp32"  # FSDP2's gathered parameters
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    grad_sync_every_micro_batch: bool = True
    compile: bool = False

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed_precision != "fp32" or self.param_dtype != "fp32" else 4

    @property
    def fp32_params_under_autocast(self) -> bool:
        return self.mixed_precision != "fp32" and self.param_dtype == "fp32"


@dataclass(frozen=True)
class Device:
    memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB
    tflops: float = DEFAULT_DEVICE_TFLOPS
    efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    reserve_gib: float = DEFAULT_RESERVE_GIB
    nvlink_gbps: float = SYSTEMS[DEFAULT_SYSTEM].nvlink_gbps  # achievable bus bandwidth inside a node
    nic_gbps: float = SYSTEMS[DEFAULT_SYSTEM].nic_gbps  # per GPU, between nodes
    gpus_per_node: int = SYSTEMS[DEFAULT_SYSTEM].gpus_per_node

    @property
    def system(self) -> System:
        return System("planned", self.nvlink_gbps, self.nic_gbps, self.gpus_per_node, self.memory_gib, self.tflops)


@dataclass(frozen=True)
class LayoutPlan:
    model: str
    dims: ParallelDims
    params_total: int
    params_per_rank: int  # rank 0's local elements after TP and FSDP sharding
    param_bytes_per_rank: int
    grad_bytes_per_rank: int
    optimizer_bytes_per_rank: int
    checkpoint_bytes_per_rank: int  # what one rank snapshots (its whole local state)
    checkpoint_bytes_total: int  # what the checkpoint holds, each element once
    host_copy_gbps: float
    storage_gbps: float
    workload: Workload = Workload()
    device: Device = Device()
    activations: Optional[ActivationMemory] = None
    fsdp_buffer_bytes: int = 0  # gathered units and unsharded gradients of FSDP2
    model_flops_per_token: int = 0
    recompute_flops_per_token: int = 0  # the forward again under full checkpointing
    comm: Optional[Communication] = None
    mcfg: Optional[ModelConfig] = None

    @property
    def state_bytes_per_rank(self) -> int:
        return self.param_bytes_per_rank + self.grad_bytes_per_rank + self.optimizer_bytes_per_rank

    @property
    def activation_bytes_per_rank(self) -> int:
        return self.activations.peak if self.activations else 0

    @property
    def total_bytes_per_rank(self) -> int:
        return (self.state_bytes_per_rank + self.activation_bytes_per_rank + self.fsdp_buffer_bytes
                + int(self.device.reserve_gib * GIB))

    @property
    def fits(self) -> bool:
        return self.total_bytes_per_rank <= self.device.memory_gib * GIB

    @property
    def compute_s(self) -> float:
        """Estimated: the step's FLOPs per rank at ``device.efficiency`` of the peak (x the compile gain)."""
        tokens = self.workload.global_batch * self.workload.seq_len / self.dims.world_size
        flops = (self.model_flops_per_token + self.recompute_flops_per_token) * tokens
        speedup = COMPILE_SPEEDUP if self.workload.compile else 1.0
        return flops / (self.device.tflops * 1e12 * self.device.efficiency * speedup)

    @property
    def step(self) -> StepTime:
        comm = self.comm
        return StepTime(self.compute_s, comm.tp_s if comm else 0.0, comm.fsdp_s if comm else 0.0)

    @property
    def step_s(self) -> float:
        """Compute, plus the TP communication, plus the FSDP communication that compute cannot hide."""
        return self.step.total_s

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.workload.global_batch * self.workload.seq_len / self.dims.world_size / self.step_s

    @property
    def mfu(self) -> float:
        tokens = self.workload.global_batch * self.workload.seq_len / self.dims.world_size
        return self.model_flops_per_token * tokens / (self.step_s * self.device.tflops * 1e12)

    @functools.cached_property  # (a frozen dataclass without slots keeps it in __dict__)
    def save(self) -> "SaveCost":
        """What one save costs each rank (save_cost: the same arithmetic scripts/plan_checkpointing.py uses)."""
        w = self.workload
        return save_cost(self.mcfg, self.dims, self.params_per_rank, self.params_total, w.seq_len, self.device,
                         self.host_copy_gbps, self.storage_gbps, w.param_dtype, w.compute_bytes, w.compile)

    @property
    def snapshot_s(self) -> float:
        return self.save.snapshot_s

    @property
    def host_staging_bytes_per_node(self) -> int:
        """The host memory an async save stages into on one node: each rank's state once (one buffer, pinned by
        registration: no power-of-two rounding, checkpoint/durable/staging.py); in /dev/shm with async_process."""
        return self.checkpoint_bytes_per_rank * self.device.gpus_per_node

    @property
    def probe_s(self) -> float:
        """The probe forward every durable save runs first on the training thread (a memory
        snapshot runs none: its restore compares bytes, checkpoint/memory/snapshot.py)."""
        return self.save.probe_s

    @property
    def blocking_s(self) -> float:
        return self.save.blocking_s

    @property
    def write_s(self) -> float:
        return self.save.write_s


@dataclass(frozen=True)
class SaveCost:
    """One durable save, per rank: the probe forward (recovery/probe.py, run first on the training thread)
    and the copy of the rank's state to host memory block training; the write runs behind. A memory
    snapshot blocks for the copy alone (``snapshot_s``): it runs no probe (checkpoint/memory/snapshot.py)."""
    probe_s: float
    snapshot_s: float  # the rank's checkpoint bytes over its host-copy bandwidth
    write_s: float  # the whole checkpoint through the storage system's aggregate bandwidth

    @property
    def blocking_s(self) -> float:
        return self.probe_s + self.snapshot_s


def save_cost(mcfg: ModelConfig, dims: ParallelDims, params_per_rank: int, params_total: int, seq_len: int,
              device: Device, host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
              storage_gbps: float = DEFAULT_STORAGE_GBPS, param_dtype: str = "bf16", compute_bytes: int = 2,
              compile_: bool = False, bytes_per_param: float = FP32_BYTES + ADAMW_STATE_BYTES) -> SaveCost:
    """The probe: PROBE_SEQUENCES x seq_len tokens of forward (a third of the training FLOPs per token, a tp
    shard of them per rank) at the device's achievable rate, with the FSDP all-gather and TP collectives of
    comm_model.probe_seconds; then the snapshot (params_per_rank x bytes_per_param to host memory). The
    write is params_total x bytes_per_param at the aggregate storage bandwidth."""
    forward = PROBE_SEQUENCES * seq_len * flops_per_token(mcfg, seq_len) / 3 / dims.tp
    speedup = COMPILE_SPEEDUP if compile_ else 1.0
    probe = probe_seconds(mcfg, dims, params_per_rank, PROBE_SEQUENCES, seq_len, forward,
                          device.tflops * 1e12 * device.efficiency * speedup, param_dtype, compute_bytes,
                          device.system)
    return SaveCost(probe_s=probe, snapshot_s=params_per_rank * bytes_per_param / (host_copy_gbps * GB),
                    write_s=params_total * bytes_per_param / (storage_gbps * GB))


_numels: Dict[str, Dict[str, int]] = {}  # one parallelization per layout in a process: seconds each at 70B


def local_param_numels(mcfg: ModelConfig, dims: ParallelDims, seq_len: int, parallel_cfg=None) -> Dict[str, int]:
    """Rank 0's number of elements of every parameter under the layout (meta device, fake
    process group of ``dims.world_size`` ranks: nothing is allocated, nothing is sent)."""
    key = repr((mcfg, dims, seq_len, parallel_cfg))
    if key not in _numels:
        _numels[key] = _parallelized_numels(mcfg, dims, seq_len, parallel_cfg)
    return dict(_numels[key])


def _parallelized_numels(mcfg: ModelConfig, dims: ParallelDims, seq_len: int, parallel_cfg) -> Dict[str, int]:
    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group: run it outside a distributed job")
    cfg = parallel_cfg or ParallelConfig(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp,
                                         device="cpu")
    model = build_model(mcfg, materialize=False)
    if dims.world_size == 1:
        return {n: p.numel() for n, p in model.named_parameters()}
    dist.init_process_group("fake", rank=0, world_size=dims.world_size, store=FakeStore())
    try:
        parallelize_model(model, dims, cfg, torch.device("cpu"), seq_len=seq_len)
        return {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def fsdp_buffer_bytes(mcfg: ModelConfig, dims: ParallelDims, workload: Workload) -> int:
    """FSDP2's unsharded memory at the busiest moment: the current and the prefetched unit
    gathered in param_dtype, and one unit's full gradients before the reduce-scatter. Without
    reshard_after_forward every unit stays gathered from its forward to its backward: at the
    start of the backward, the whole model (its tp shard) is in memory in param_dtype. With
    grad_sync_every_micro_batch=false and more than one micro-batch, every unit keeps its unsharded
    gradients (in reduce_dtype: FSDP2 accumulates them there) until the last micro-batch's reduce-scatter."""
    if not dims.fsdp_enabled:
        return 0
    unit = max(count_params(mcfg).per_layer, mcfg.vocab_size * mcfg.dim) // dims.tp
    grads = unit * DTYPE_BYTES[workload.reduce_dtype]
    if not workload.grad_sync_every_micro_batch and workload.global_batch > workload.micro_batch * dims.dp:
        grads = count_params(mcfg).total // dims.tp * DTYPE_BYTES[workload.reduce_dtype]
    if not workload.reshard_after_forward:
        return count_params(mcfg).total // dims.tp * DTYPE_BYTES[workload.param_dtype] + grads
    return unit * 2 * DTYPE_BYTES[workload.param_dtype] + grads


def plan_layout(mcfg: ModelConfig, dims: ParallelDims, seq_len: int, parallel_cfg=None,
                host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
                storage_gbps: float = DEFAULT_STORAGE_GBPS, workload: Optional[Workload] = None,
                device: Optional[Device] = None) -> LayoutPlan:
    local = sum(local_param_numels(mcfg, dims, seq_len, parallel_cfg).values())
    total = count_params(mcfg).total
    workload = workload or Workload(seq_len=seq_len)
    acts = activation_memory(mcfg, workload.micro_batch, seq_len, dims.tp, workload.activation_checkpoint,
                             workload.compute_bytes, workload.loss_parallel, workload.fp32_params_under_autocast)
    device = device or Device()
    recipe = Recipe(micro_batch=workload.micro_batch,
                    grad_accum=max(1, workload.global_batch // (workload.micro_batch * dims.dp)), seq_len=seq_len,
                    param_dtype=workload.param_dtype, reduce_dtype=workload.reduce_dtype,
                    compute_bytes=workload.compute_bytes, reshard_after_forward=workload.reshard_after_forward,
                    grad_sync_every_micro_batch=workload.grad_sync_every_micro_batch,
                    activation_checkpoint=workload.activation_checkpoint, loss_parallel=workload.loss_parallel)
    return LayoutPlan(
        model=mcfg.name, dims=dims, params_total=total, params_per_rank=local,
        param_bytes_per_rank=local * FP32_BYTES,
        grad_bytes_per_rank=local * FP32_BYTES,
        optimizer_bytes_per_rank=local * ADAMW_STATE_BYTES,
        checkpoint_bytes_per_rank=local * (FP32_BYTES + ADAMW_STATE_BYTES),
        checkpoint_bytes_total=total * (FP32_BYTES + ADAMW_STATE_BYTES),
        host_copy_gbps=host_copy_gbps, storage_gbps=storage_gbps,
        workload=workload, device=device, activations=acts,
        fsdp_buffer_bytes=fsdp_buffer_bytes(mcfg, dims, workload),
        model_flops_per_token=flops_per_token(mcfg, seq_len),
        recompute_flops_per_token=recompute_flops_per_token(mcfg, seq_len, workload.activation_checkpoint),
        comm=communication(mcfg, dims, local, recipe, device.system), mcfg=mcfg,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_plan(plan: LayoutPlan) -> str:
    d = plan.dims
    lines = [
        f"layout: {d.describe()} = {d.world_size} ranks (model {plan.model})",
        f"parameters: {plan.params_total:,} total; {plan.params_per_rank:,} per rank "
        f"({plan.params_total / max(plan.params_per_rank, 1):,.1f}x fewer)",
        "per rank (largest shard, fp32 master weights, AdamW):",
        f"  parameters {_gib(plan.param_bytes_per_rank)} | gradients {_gib(plan.grad_bytes_per_rank)} | "
        f"optimizer {_gib(plan.optimizer_bytes_per_rank)} | total {_gib(plan.state_bytes_per_rank)}",
        *_activation_lines(plan),
        f"checkpoint: {_gib(plan.checkpoint_bytes_per_rank)} per rank, {_gib(plan.checkpoint_bytes_total)} in total "
        f"(parameters + optimizer, 12 B/param)",
        f"  blocking {plan.blocking_s:,.2f} s: probe forward {plan.probe_s:,.2f} s "
        f"({PROBE_SEQUENCES} x {plan.workload.seq_len} tokens) + snapshot {plan.snapshot_s:,.2f} s at "
        f"{plan.host_copy_gbps:g} GB/s host copy per rank; "
        f"write {plan.write_s:,.1f} s at {plan.storage_gbps:g} GB/s aggregate storage",
        f"  host staging of an async save: {_gib(plan.host_staging_bytes_per_node)} per node of "
        f"{plan.device.gpus_per_node} GPUs, pinned (in /dev/shm with async_process; the memory tier adds its own)",
        f"checkpoint interval (Young/Daly, 50,000 h device MTBF): async every "
        f"{checkpoint_interval_s(plan):,.0f} s, sync every {checkpoint_interval_s(plan, asynchronous=False):,.0f} s",
    ]
    return "\n".join(lines)


def _activation_lines(plan: LayoutPlan) -> list:
    w, a, dev = plan.workload, plan.activations, plan.device
    tp = f"tp {plan.dims.tp} with sequence parallel" if plan.dims.tp > 1 else "no tp"
    loss = ", loss parallel" if w.loss_parallel else ""
    verdict = "fits" if plan.fits else "does NOT fit"
    return [
        f"activations (micro batch {w.micro_batch} x seq {w.seq_len}, {w.compute_bytes * 8}-bit compute, {tp}, "
        f"activation checkpointing {w.activation_checkpoint}{loss}):",
        f"  saved for backward {_gib(a.saved)} ({a.n_layers} blocks x {_gib(a.per_block)} + outside the blocks "
        f"{_gib(a.outside_blocks)}" + (f" + bf16 weight copies {_gib(a.weight_copies)}" if a.weight_copies else "")
        + f") | backward transient {_gib(max(a.recompute, a.loss_backward))} | total {_gib(a.peak)}",
        f"  FSDP2 gathered units and unsharded gradients {_gib(plan.fsdp_buffer_bytes)} | "
        f"reserve (CUDA context, NCCL, fragmentation) {_gib(int(dev.reserve_gib * GIB))}",
        f"memory per rank: {_gib(plan.total_bytes_per_rank)} of {dev.memory_gib:g} GiB: {verdict}",
        *_step_lines(plan),
    ]


def _step_lines(plan: LayoutPlan) -> list:
    w, dev, c, t = plan.workload, plan.device, plan.comm, plan.step
    gb = 1e9
    compiled = f" x {COMPILE_SPEEDUP:.3f} (compile)" if w.compile else ""
    return [
        f"communication per step and rank (received; NVLink {dev.nvlink_gbps:g} GB/s, NIC {dev.nic_gbps:g} GB/s "
        f"per GPU, {dev.gpus_per_node} GPUs per node):",
        f"  FSDP all-gather {c.fsdp_all_gather_bytes / gb:,.1f} GB ({w.param_dtype}"
        f"{', again in backward' if w.reshard_after_forward else ', once per micro-batch'}) + reduce-scatter "
        f"{c.fsdp_reduce_scatter_bytes / gb:,.1f} GB ({w.reduce_dtype}) + HSDP all-reduce "
        f"{c.hsdp_all_reduce_bytes / gb:,.1f} GB over {c.fsdp_link}/{c.hsdp_link}: {c.fsdp_s:,.2f} s, "
        f"hidden behind compute up to its time",
        f"  TP (sequence parallel) {c.tp_bytes / gb:,.1f} GB over {c.tp_link}: {c.tp_s:,.2f} s, exposed",
        f"step time (estimate): compute {t.compute_s:,.2f} s ({dev.efficiency:.0%} of {dev.tflops:g} TFLOP/s"
        f"{compiled}) + TP {t.tp_s:,.2f} s + FSDP not hidden {t.fsdp_exposed_s:,.2f} s = {t.total_s:,.2f} s "
        f"for {w.global_batch} x {w.seq_len} tokens: {t.bound}-bound; {plan.tokens_per_s_per_device:,.0f} "
        f"tokens/s per device; MFU {plan.mfu:.1%}",
        *_margin_lines(plan),
    ]


def _margin_lines(plan: LayoutPlan) -> list:
    m = compute_bound_margin(plan)
    if m is None:
        return []
    nic = f", or at a NIC of {m.nic_gbps:,.1f} GB/s or less" if m.nic_gbps else ""
    if m.spare >= 0:
        return [f"  margin: FSDP {plan.step.fsdp_s:,.2f} s hides in {plan.step.compute_s:,.2f} s of compute "
                f"({m.spare:.1%} to spare); it shows from an achievable fraction of {m.efficiency:.3f}{nic}"]
    return [f"  margin: FSDP {plan.step.fsdp_s:,.2f} s exceeds {plan.step.compute_s:,.2f} s of compute; compute-bound "
            f"below an achievable fraction of {m.efficiency:.3f}"
            + (f", or above a NIC of {m.nic_gbps:,.1f} GB/s" if m.nic_gbps else "")]


@dataclass(frozen=True)
class Margin:
    """How far a compute-bound step is from exposing its FSDP traffic (negative spare: already exposed)."""
    spare: float  # compute / FSDP time - 1
    efficiency: float  # the achievable fraction of the peak at which compute shrinks to the FSDP time
    nic_gbps: Optional[float]  # the NIC bandwidth at which FSDP grows to the compute time (all of it on the NIC)


def compute_bound_margin(plan: LayoutPlan) -> Optional[Margin]:
    """Compute time over FSDP + HSDP time, and the efficiency and NIC bandwidth at which they meet: compute
    is proportional to 1 / efficiency, the FSDP time to 1 / bandwidth of its link. None without FSDP."""
    t, c = plan.step, plan.comm
    if not t.fsdp_s > 0:
        return None
    on_nic = {c.fsdp_link, c.hsdp_link} <= {"nic", "-"}
    return Margin(spare=t.compute_s / t.fsdp_s - 1, efficiency=plan.device.efficiency * t.compute_s / t.fsdp_s,
                  nic_gbps=plan.device.nic_gbps * t.fsdp_s / t.compute_s if on_nic else None)


def checkpoint_interval_s(plan: LayoutPlan, device_mtbf_hours: Optional[float] = None,
                          asynchronous: bool = True) -> float:
    """Young/Daly interval T* = sqrt(2 M C) for this layout (recovery/interval.py): M = device MTBF
    / world size; C = the blocking part, probe + snapshot (async, and never shorter than the write), or
    blocking + write (sync)."""
    mtbf = cluster_mtbf_s(device_mtbf_hours or DEFAULT_DEVICE_MTBF_HOURS, plan.dims.world_size)
    if asynchronous:
        return max(young_daly_interval_s(mtbf, plan.blocking_s), plan.write_s)
    return young_daly_interval_s(mtbf, plan.blocking_s + plan.write_s)


def plan_as_dict(plan: LayoutPlan) -> Dict[str, object]:
    out = {k: v for k, v in plan.__dict__.items() if k != "dims"}
    out = {k: v for k, v in out.items() if k not in ("workload", "device", "activations", "comm", "mcfg")}
    a = plan.activations
    out.update(dp_replicate=plan.dims.dp_replicate, dp_shard=plan.dims.dp_shard, tp=plan.dims.tp,
               world_size=plan.dims.world_size, state_bytes_per_rank=plan.state_bytes_per_rank,
               snapshot_s=plan.snapshot_s, host_staging_bytes_per_node=plan.host_staging_bytes_per_node,
               probe_s=plan.probe_s, blocking_s=plan.blocking_s, write_s=plan.write_s,
               activation_saved_bytes=a.saved, activation_per_block_bytes=a.per_block,
               activation_bytes_per_rank=plan.activation_bytes_per_rank,
               total_bytes_per_rank=plan.total_bytes_per_rank, device_memory_gib=plan.device.memory_gib,
               fits=plan.fits, step_s=plan.step_s, mfu=plan.mfu, compute_s=plan.compute_s,
               tokens_per_s_per_device=plan.tokens_per_s_per_device, bound=plan.step.bound,
               **_margin_dict(plan),
               **{f"comm_{k}": v for k, v in plan.comm.__dict__.items()}, **plan.workload.__dict__)
    return out


def _margin_dict(plan: LayoutPlan) -> Dict[str, object]:
    m = compute_bound_margin(plan)
    return {"margin_spare": m and m.spare, "margin_efficiency": m and m.efficiency,
            "margin_nic_gbps": m and m.nic_gbps}


def world_size_for(dp_replicate: int, dp_shard: int, tp: int, world_size: Optional[int]) -> int:
    """The planner's world: given, or the product of the layout when dp_shard is explicit."""
    if world_size:
        return world_size
    if dp_shard == -1:
        raise ValueError(
            "parallel.dp_shard=-1 fills the world size, which a plan cannot know: give the layout "
            "explicitly (e.g. parallel.dp_shard=64 parallel.tp=8) or the world size (--world-size / WORLD_SIZE)"
        )
    return dp_replicate * dp_shard * tp


def plan_from_config(cfg, world_size: Optional[int] = None, host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
                     storage_gbps: float = DEFAULT_STORAGE_GBPS, device: Optional[Device] = None) -> LayoutPlan:
    """The plan for a checked training config (train.py dry_run and scripts/plan.py: trainer/config.py's)."""
    p, t, mcfg = cfg.parallel, cfg.training, cfg.model
    world = world_size_for(p.dp_replicate, p.dp_shard, p.tp, world_size)
    dims = resolve_parallel_dims(p.dp_replicate, p.dp_shard, p.tp, world, p.force_fsdp)
    check_tensor_parallel_fits(mcfg, dims.tp, t.seq_len)
    # Without FSDP2 (one data-parallel rank, parallel.force_fsdp off) nothing casts the parameters:
    # param_dtype and reduce_dtype have no effect, and autocast computes on bf16 copies of fp32 weights.
    param_dtype, reduce_dtype = (p.param_dtype, p.reduce_dtype) if dims.fsdp_enabled else ("fp32", "fp32")
    workload = Workload(seq_len=t.seq_len, micro_batch=t.micro_batch_size, global_batch=t.global_batch_size,
                        activation_checkpoint=p.activation_checkpoint, loss_parallel=p.loss_parallel,
                        mixed_precision=t.mixed_precision, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                        reshard_after_forward=p.reshard_after_forward,
                        grad_sync_every_micro_batch=p.grad_sync_every_micro_batch, compile=p.compile)
    return plan_layout(mcfg, dims, t.seq_len, p, host_copy_gbps, storage_gbps, workload, device)
