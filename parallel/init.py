"""Process-group start-up: backend by device (nccl on CUDA, gloo on CPU), explicit timeouts.

On CUDA the default group is NCCL, which takes CUDA tensors only; the control values every rank
agrees on (flags, timings, verdicts) go to a gloo group made right after it
(parallel/collectives.py), so no CPU tensor is ever sent to the default group.

The first step may legitimately be slow (compile, allocator warm-up, first all-gathers), so
the process group starts with ``parallel.collective_timeout_s`` (minutes). After the first
step a hung peer should be noticed in seconds to minutes, not NCCL's 30: trainer/run.py then calls
``set_collective_timeout(parallel.collective_timeout_after_first_step_s, groups)`` for the
training groups (the default group and the device mesh's sub-groups). Verified on gloo by
tests/integration/test_parallel.py (a stalled peer on a mesh sub-group fails after the new timeout).

Under torchrun a worker must not outlive its launcher (an orphan would train on and commit
next to the relaunched job): ``init_distributed`` first asks the kernel to SIGKILL this process
when the agent that started it exits (``die_with_launcher``), and connects to the agent's
store with a timeout of its own (``STORE_CONNECT_TIMEOUT_S``), not the collective timeout:
the store is up before the agent starts any worker, so a connection that takes longer means
the agent (on another node, for a multi-node job) is gone.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from parallel import collectives
from parallel.config import DEVICES

# Connecting to torchrun's store (with the client's retries it took up to 2.2x this: tests/integration/test_orphans.py);
# once connected, waits on the store get the collective timeout.
STORE_CONNECT_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def die_with_launcher(environ=os.environ) -> bool:
    """Under torchrun (TORCHELASTIC_RUN_ID set) on Linux: SIGKILL this process when the agent that
    started it exits, however it exits (PR_SET_PDEATHSIG). SIGKILL, not SIGTERM: SIGTERM would
    start a preemption save, i.e. a commit after the launcher is gone. True when set.

    The kernel sends it when the *thread* that forked this process ends; torchrun starts its
    workers from the agent's main thread, which lives as long as the agent."""
    if "TORCHELASTIC_RUN_ID" not in environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return True


def init_distributed(device_choice: str, timeout_s: float, group_of_one: bool = False) -> WorldInfo:
    """Join the process group torchrun set up (or run alone when launched by plain python). With
    ``group_of_one`` (parallel.force_fsdp) a world of one rank gets a process group too, on an in-memory
    store: FSDP2's mesh needs one."""
    die_with_launcher()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_choice, local_rank)
    if (world_size > 1 or group_of_one) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _restart_store(rank, world_size, timeout) if world_size > 1 else \
            {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **store,
        )
        collectives.init_control_group(timeout_s)  # NCCL takes no CPU tensor: control values go to gloo
    return WorldInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _restart_store(rank: int, world_size: int, timeout: datetime.timedelta,
                   connect_timeout_s: float = STORE_CONNECT_TIMEOUT_S) -> dict:
    """The store this attempt's process group starts from, clean of earlier attempts' keys (gloo
    ranks would read their peers' old addresses from them).

    Multi-node launches (scripts/torchrun_preemptible.py sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1):
    each rendezvous round's rank-0 agent picks MASTER_ADDR:MASTER_PORT and every agent of the round
    reads it from the round's keys; rank 0 hosts a fresh store there, so one fixed prefix serves.
    The restart count would not: agents count their own workers' failures only (a replacement starts
    at 0; an agent whose workers were healthy restarts them for a joining node without counting).
    torch's shared store (the default, one agent: --standalone, one node) outlives attempts: this
    attempt's keys go under its restart count, which the one agent gives all its workers.

    The agent's store is up before any worker starts: connecting to it gets
    ``connect_timeout_s``; waits on it afterwards (peers joining) get ``timeout``."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        return {}  # not under torchrun: the default env:// rendezvous
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if agent_hosts_store:
        connect = datetime.timedelta(seconds=min(connect_timeout_s, timeout.total_seconds()))
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=connect)
        except RuntimeError as exc:  # DistStoreError
            raise RuntimeError(f"rank {rank} could not connect to torchrun's store at {host}:{port} within "
                               f"{connect.total_seconds():.0f} s: its agent is gone ({exc})") from exc
        store.set_timeout(timeout)
        prefix = f"/trainer/attempt_{restart}"
    else:  # rank 0 hosts a new store for this attempt; the others wait for it as long as for any peer
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        # A new store per round: nothing stale to avoid, and restart counts differ between agents.
        prefix = "/trainer/attempt"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world_size}


def set_collective_timeout(timeout_s: float, groups: Optional[Iterable[dist.ProcessGroup]] = None) -> int:
    """Change the timeout of ``groups`` (default: every process group this rank is in);
    returns how many groups were changed. trainer/run.py passes the training groups only
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
    collectives.forget_groups()
