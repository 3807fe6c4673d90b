"""Cross-replica consistency: with dp_replicate > 1 every replica must hold identical weights.

A cheap fingerprint per rank (the int64 sum of each parameter's raw 32-bit words: any single
bit flip changes it) is gathered over the replicate dimension; ranks of one replica group
hold the same shard, so their fingerprints must be equal. With three or more replicas the
odd one out is named by majority; with two, both are named as disagreeing.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel import collectives


def param_fingerprint(model: nn.Module, device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64, device=device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        data = local.detach().contiguous()
        if data.element_size() == 4:
            words = data.view(torch.int32)
        elif data.element_size() == 2:
            words = data.view(torch.int16)
        else:
            words = data.view(torch.int64)
        total += words.sum(dtype=torch.int64)
    return total


def disagreeing_replicas(fingerprints: List[int]) -> List[int]:
    """Indices of replicas whose fingerprint differs from the majority (all, if no majority)."""
    counts = Counter(fingerprints)
    if len(counts) == 1:
        return []
    value, votes = counts.most_common(1)[0]
    if votes * 2 > len(fingerprints):
        return [i for i, f in enumerate(fingerprints) if f != value]
    return list(range(len(fingerprints)))


def check_replicas(model: nn.Module, device: torch.device, replicate_group: Optional[dist.ProcessGroup]) -> List[int]:
    """Replica indices (within this rank's replicate group) that disagree; [] when consistent."""
    if replicate_group is None or dist.get_world_size(replicate_group) < 2:
        return []
    mine = param_fingerprint(model, device)
    gathered = collectives.all_gather(mine, replicate_group)
    return disagreeing_replicas([int(t) for t in gathered])
