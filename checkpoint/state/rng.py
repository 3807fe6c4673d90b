"""Random number generator state of one rank: python, numpy, torch CPU and this rank's CUDA device.

Policy on resume: at the same world size every rank restores exactly its own saved state
(bitwise continuation). At a different world size there is no meaningful mapping from old
ranks to new ones, so every rank reseeds all its generators from (seed, step, rank): the run
stays deterministic and ranks stay decorrelated, and the log says so.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Dict

import numpy as np
import torch


def capture_rng() -> Dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()  # this rank's device (LOCAL_RANK's) only
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """Restore this rank's generators. Only the current CUDA device's: a restart under another
    CUDA_VISIBLE_DEVICES, or on a node with another device count, is not an error."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    saved = state.get("torch_cuda")
    if saved is None or not torch.cuda.is_available():
        return
    if isinstance(saved, (list, tuple)):  # written by an older version: every visible device's state
        index = torch.cuda.current_device()
        if index >= len(saved):
            return  # this device was not visible to the saving process: its generator keeps its seed
        saved = saved[index]
    torch.cuda.set_rng_state(saved)


def reseed_rng(seed: int, step: int, rank: int) -> int:
    """The changed-world-size policy: one derived seed for every generator of this rank."""
    derived = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") >> 1
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # also seeds every CUDA device
    return derived
