"""Process-group start-up: backend by device (nccl on CUDA, gloo on CPU), explicit timeouts.

The first step may legitimately be slow (compile, allocator warm-up, first all-gathers), so
the process group starts with ``parallel.collective_timeout_s`` (minutes). After the first
step a hung peer should be noticed in seconds to minutes, not NCCL's 30: train.py then calls
``set_collective_timeout(parallel.collective_timeout_after_first_step_s, groups)`` for the
training groups (the default group and the device mesh's sub-groups). Verified on gloo by
tests/test_parallel.py (a stalled peer on a mesh sub-group fails after the new timeout).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from configs.constants import DEVICES


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.device=cuda but CUDA is not available; use parallel.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if choice == "cpu":
        return torch.device("cpu")
    raise ValueError(f"parallel.device={choice!r}: choose one of {list(DEVICES)}")


def init_distributed(device_choice: str, timeout_s: float) -> WorldInfo:
    """Join the process group torchrun set up (or run alone when launched by plain python)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
            **_restart_store(rank, world_size, timeout),
        )
    return WorldInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """After a torchrun restart (``--max-restarts``) the agent's store still holds the previous
    attempt's keys, and gloo ranks would read their peers' old addresses from it. Key this
    attempt's process group under its restart count so every attempt starts clean."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        return {}  # not under torchrun: the default env:// rendezvous
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    return {"store": dist.PrefixStore(f"/trainer/attempt_{restart}", store), "rank": rank, "world_size": world_size}


def set_collective_timeout(timeout_s: float, groups: Optional[Iterable[dist.ProcessGroup]] = None) -> int:
    """Change the timeout of ``groups`` (default: every process group this rank is in);
    returns how many groups were changed. train.py passes the training groups only
    (``Parallelized.process_groups``): a checkpoint writer's own group keeps its timeout."""
    if not dist.is_initialized():
        return 0
    timeout = datetime.timedelta(seconds=timeout_s)
    if groups is None:
        groups = [dist.group.WORLD] + [pg for pg in dist.distributed_c10d._world.pg_map if pg is not dist.group.WORLD]
    unique = list({id(g): g for g in groups}.values())
    for group in unique:
        # Private but stable since torch 2.2; applies to both gloo and nccl backends.
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return len(unique)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
