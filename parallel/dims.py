"""The parallel layout: world_size = dp_replicate x dp_shard x tp, checked against the world."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1


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


def resolve_parallel_dims(dp_replicate: int, dp_shard: int, tp: int, world_size: int) -> ParallelDims:
    """Fill dp_shard=-1 from the world size; stop with the numbers and alternatives otherwise."""
    if dp_replicate < 1 or tp < 1 or (dp_shard < 1 and dp_shard != -1):
        raise ValueError(
            f"parallel sizes must be >= 1 (dp_shard may be -1 to fill): "
            f"dp_replicate={dp_replicate} dp_shard={dp_shard} tp={tp}"
        )
    if dp_shard == -1:
        if world_size % (dp_replicate * tp):
            raise ValueError(
                f"world size {world_size} is not divisible by dp_replicate ({dp_replicate}) x tp ({tp}) = "
                f"{dp_replicate * tp}, so dp_shard=-1 cannot be filled. Valid layouts: "
                + "; ".join(_layouts(world_size, dp_replicate, tp))
            )
        dp_shard = world_size // (dp_replicate * tp)
    if dp_replicate * dp_shard * tp != world_size:
        raise ValueError(
            f"parallel layout dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} = "
            f"{dp_replicate * dp_shard * tp} ranks, but the world size is {world_size}. Valid layouts: "
            + "; ".join(_layouts(world_size, dp_replicate, tp))
        )
    return ParallelDims(dp_replicate, dp_shard, tp, world_size)
