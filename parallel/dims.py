"""The parallel layout: world_size = dp_replicate x dp_shard x tp, checked against the world.

Mesh dimensions are listed outermost first in ``ParallelDims.mesh_dims``: replicas talk
least (one all-reduce per step), tensor-parallel ranks talk most (every layer), so tp is
innermost and lands inside a node. Pipeline parallelism would be one more entry in front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from configs.keys import divisors

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")  # the mesh's axes, outermost first: named here only
REPLICATE, SHARD, TP = MESH_DIM_NAMES


def data_parallel_size(layout: Dict[str, int]) -> int:
    """The data-parallel ranks of a layout as a checkpoint records it (``ParallelDims.layout``)."""
    return layout.get(REPLICATE, 1) * layout.get(SHARD, 1)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int  # full model replicas (HSDP's outer dimension): gradients all-reduced
    dp_shard: int  # FSDP2 ranks: parameters, gradients and optimizer state sharded
    tp: int  # tensor-parallel ranks: every matmul split, same data on each
    world_size: int
    force_fsdp: bool = False  # parallel.force_fsdp: FSDP2 even with one data-parallel rank (a size-1 mesh)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model whenever there is more than one data-parallel rank, or when forced."""
        return self.dp > 1 or self.force_fsdp

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def mesh_dims(self) -> List[Tuple[str, int]]:
        return list(zip(MESH_DIM_NAMES, (self.dp_replicate, self.dp_shard, self.tp)))

    @property
    def layout(self) -> Dict[str, int]:
        """{axis: size}, as manifests record it."""
        return dict(self.mesh_dims)

    def describe(self) -> str:
        return " x ".join(f"{axis}={size}" for axis, size in self.mesh_dims)


def _layouts(world_size: int, dp_replicate: int, tp: int) -> List[str]:
    """Valid (dp_replicate, dp_shard, tp) for this world size, closest to the request first."""
    out = []
    for t in range(1, world_size + 1):
        if world_size % t:
            continue
        for r in range(1, world_size // t + 1):
            if (world_size // t) % r:
                continue
            out.append((abs(t - tp) + abs(r - dp_replicate), r, world_size // (t * r), t))
    return [f"dp_replicate={r} dp_shard={s} tp={t}" for _, r, s, t in sorted(out)[:4]]


def resolve_parallel_dims(dp_replicate: int, dp_shard: int, tp: int, world_size: int,
                          force_fsdp: bool = False) -> ParallelDims:
    """Fill dp_shard=-1 from the world size; stop with the numbers and alternatives otherwise."""
    if dp_replicate < 1 or tp < 1 or (dp_shard < 1 and dp_shard != -1):
        raise ValueError(
            f"parallel sizes must be >= 1 (dp_shard may be -1 to fill): "
            f"dp_replicate={dp_replicate} dp_shard={dp_shard} tp={tp}"
        )
    if dp_shard == -1:
        if world_size % (dp_replicate * tp):
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.dp_replicate ({dp_replicate}) x "
                f"parallel.tp ({tp}) = "
                f"{dp_replicate * tp}, so dp_shard=-1 cannot be filled. Valid layouts: "
                + "; ".join(_layouts(world_size, dp_replicate, tp))
            )
        dp_shard = world_size // (dp_replicate * tp)
    if dp_replicate * dp_shard * tp != world_size:
        raise ValueError(
            f"parallel layout parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard} x parallel.tp={tp} = "
            f"{dp_replicate * dp_shard * tp} ranks, but the world size is {world_size}. Valid layouts: "
            + "; ".join(_layouts(world_size, dp_replicate, tp))
        )
    return ParallelDims(dp_replicate, dp_shard, tp, world_size, force_fsdp)


def check_tensor_parallel_fits(mcfg, tp: int, seq_len: int) -> None:
    """Every tensor-parallel split must be even: heads, KV heads, FFN width, vocabulary, and
    (sequence parallel) the sequence. Name what does not divide and the tp degrees that work."""
    if tp == 1:
        return
    sizes = {
        "model.n_heads": mcfg.n_heads,
        "model.n_kv_heads": mcfg.kv_heads,
        "FFN hidden size": mcfg.ffn_hidden_dim,
        "model.vocab_size": mcfg.vocab_size,
        "training.seq_len (sequence parallel)": seq_len,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp]
    if not bad:
        return
    valid = divisors(math.gcd(*sizes.values()))  # a tp divides them all when it divides their gcd
    raise ValueError(
        f"parallel.tp={tp} does not divide {', '.join(bad)}; each tensor-parallel rank must hold a whole "
        f"number of heads, KV heads, FFN columns, vocabulary rows and sequence positions. "
        f"tp degrees that divide all of them: {valid}"
    )
