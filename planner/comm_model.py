"""Communication of one training step, per rank, and the step time it leaves (planner/plan.py).

Volumes are the bytes one rank receives in a ring collective of ``n`` ranks over a tensor of
``S`` bytes (what it sends is the same): an all-gather or a reduce-scatter moves (n-1)/n x S, an
all-reduce twice that. NCCL's "bus bandwidth" is defined on exactly these bytes, so time =
volume / bus bandwidth of the link the group crosses.

  FSDP2 (dp_shard ranks)   all-gather of the parameters in param_dtype before each micro-batch's
                           forward, again before its backward when reshard_after_forward; a
                           reduce-scatter of the gradients in reduce_dtype after each backward
                           (once per step with grad_sync_every_micro_batch=false)
  HSDP (dp_replicate)      an all-reduce of the sharded gradients across replicas, once per step: the
                           trainer defers it to the last micro-batch (parallel/fsdp.py set_grad_sync)
  TP + sequence parallel   the collectives of the model's tensor-parallel plan, each over one micro-batch's
                           activations (model/counting.py counts them per block and outside the
                           blocks, with what checkpointing recomputes); without loss parallel, an
                           all-gather of the logits (vocabulary-wide) per micro-batch

Where a group runs: the mesh is (dp_replicate, dp_shard, tp) with tp innermost, so a group whose
ranks lie within ``gpus_per_node`` consecutive ranks uses NVLink, any other the per-GPU NIC.

Overlap: FSDP2 prefetches the next block's all-gather and reduce-scatters the previous block's
gradients while the current block computes, so its collectives (and HSDP's all-reduce) are hidden
up to the compute time; only the excess shows. TP collectives sit between dependent matmuls (no
async TP here) and show in full. The step is compute + TP + max(0, FSDP - compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.counting import TP_COLLECTIVES_OUTSIDE_BLOCKS, TP_COLLECTIVES_PER_BLOCK
from parallel.dims import ParallelDims

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class System:
    """A GPU system's numbers: achievable bus bandwidths (GB/s, NCCL's definition), memory, peak."""
    name: str
    nvlink_gbps: float
    nic_gbps: float  # per GPU, between nodes
    gpus_per_node: int
    memory_gib: float
    peak_tflops: float  # dense bf16


# NVLink 4 is 450 GB/s each way per GPU; NCCL reaches about 80% of it on large all-gathers and
# reduce-scatters. One 400 Gb/s NIC per GPU is 50 GB/s; about 90% of it is usable. Assumed, not
# measured here (no GPU has run this trainer). Memory: an H200 reports 143,771 MiB (nvidia-smi
# memory.total; its "141 GB" is that in GiB, rounded); an H100 80GB reports 81,559 MiB (79.6 GiB),
# planned as 80 GiB (the 4 GiB reserve covers the difference).
SYSTEMS = {
    "h100": System("h100", nvlink_gbps=360.0, nic_gbps=45.0, gpus_per_node=8, memory_gib=80.0, peak_tflops=989.0),
    "h200": System("h200", nvlink_gbps=360.0, nic_gbps=45.0, gpus_per_node=8, memory_gib=143771 / 1024,
                   peak_tflops=989.0),
}
DEFAULT_SYSTEM = "h100"


@dataclass(frozen=True)
class Recipe:
    """What decides the step's communication (from the training and parallel config)."""
    micro_batch: int
    grad_accum: int
    seq_len: int
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    compute_bytes: int = 4  # activations on the wire (TP)
    reshard_after_forward: bool = True
    grad_sync_every_micro_batch: bool = True
    activation_checkpoint: str = "none"
    loss_parallel: bool = False


@dataclass(frozen=True)
class Communication:
    """Bytes one rank receives per step, and the seconds they take on their links."""
    fsdp_all_gather_bytes: int
    fsdp_reduce_scatter_bytes: int
    hsdp_all_reduce_bytes: int
    tp_bytes: int
    fsdp_link: str  # "nvlink" | "nic" | "-"
    hsdp_link: str
    tp_link: str
    fsdp_s: float  # all-gathers + reduce-scatters + HSDP all-reduce: hidden behind compute up to its time
    tp_s: float  # exposed


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_s: float
    fsdp_s: float

    @property
    def fsdp_exposed_s(self) -> float:
        return max(0.0, self.fsdp_s - self.compute_s)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_s + self.fsdp_exposed_s

    @property
    def bound(self) -> str:
        return "communication (FSDP)" if self.fsdp_s > self.compute_s else "compute"


def _link(group_span: int, system: System) -> str:
    """NVLink if the group's ranks fit in one node (a span of consecutive ranks), else the NIC."""
    return "nvlink" if group_span <= system.gpus_per_node else "nic"


def link_gbps(link: str, system: System) -> float:
    return system.nvlink_gbps if link == "nvlink" else system.nic_gbps


def communication(mcfg: ModelConfig, dims: ParallelDims, params_per_rank: int, recipe: Recipe,
                  system: System) -> Communication:
    """Per-step bytes and seconds of the collectives the trainer issues under this layout."""
    n, r, tp = dims.dp_shard, dims.dp_replicate, dims.tp
    micro = recipe.grad_accum  # micro-batches per step
    syncs = micro if recipe.grad_sync_every_micro_batch else 1
    param_b, reduce_b = DTYPE_BYTES[recipe.param_dtype], DTYPE_BYTES[recipe.reduce_dtype]
    gathers = 2 if recipe.reshard_after_forward else 1
    fsdp = dims.fsdp_enabled and n > 1
    all_gather = micro * gathers * (n - 1) * params_per_rank * param_b if fsdp else 0
    reduce_scatter = syncs * (n - 1) * params_per_rank * reduce_b if fsdp else 0
    all_reduce = 2 * (r - 1) * params_per_rank * reduce_b // r if r > 1 else 0  # once per step
    activation = recipe.micro_batch * recipe.seq_len * mcfg.dim * recipe.compute_bytes
    count = mcfg.n_layers * TP_COLLECTIVES_PER_BLOCK[recipe.activation_checkpoint] + TP_COLLECTIVES_OUTSIDE_BLOCKS
    logits = 0 if recipe.loss_parallel else recipe.micro_batch * recipe.seq_len * mcfg.vocab_size * recipe.compute_bytes
    tp_bytes = micro * (count * activation + logits) * (tp - 1) // tp if tp > 1 else 0
    fsdp_link = _link(n * tp, system) if fsdp else "-"
    hsdp_link = _link(dims.world_size, system) if r > 1 else "-"
    tp_link = _link(tp, system) if tp > 1 else "-"
    fsdp_s = 0.0
    if fsdp:
        fsdp_s += (all_gather + reduce_scatter) / (link_gbps(fsdp_link, system) * 1e9)
    if r > 1:
        fsdp_s += all_reduce / (link_gbps(hsdp_link, system) * 1e9)
    tp_s = tp_bytes / (link_gbps(tp_link, system) * 1e9) if tp > 1 else 0.0
    return Communication(all_gather, reduce_scatter, all_reduce, tp_bytes, fsdp_link, hsdp_link, tp_link,
                         fsdp_s, tp_s)


def probe_seconds(mcfg: ModelConfig, dims: ParallelDims, params_per_rank: int, sequences: int, seq_len: int,
                  forward_flops_per_rank: float, flops_per_s: float, param_dtype: str, compute_bytes: int,
                  system: System) -> float:
    """The probe (recovery/probe.py) before each save: a forward of ``sequences`` sequences, one at
    a time, on every rank: its compute, the FSDP all-gather of every parameter once (prefetched
    behind the compute), and the TP collectives of a forward (half of forward and backward's), exposed."""
    compute_s = forward_flops_per_rank / flops_per_s
    gather_s = 0.0
    if dims.fsdp_enabled and dims.dp_shard > 1:
        volume = (dims.dp_shard - 1) * params_per_rank * DTYPE_BYTES[param_dtype]
        gather_s = volume / (link_gbps(_link(dims.dp_shard * dims.tp, system), system) * 1e9)
    tp_s = 0.0
    if dims.tp > 1:
        forward = (TP_COLLECTIVES_PER_BLOCK["none"] * mcfg.n_layers + TP_COLLECTIVES_OUTSIDE_BLOCKS) // 2
        volume = sequences * forward * seq_len * mcfg.dim * compute_bytes * (dims.tp - 1) // dims.tp
        tp_s = volume / (link_gbps(_link(dims.tp, system), system) * 1e9)
    return max(compute_s, gather_s) + tp_s
