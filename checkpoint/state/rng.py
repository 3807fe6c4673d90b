"""Random number generator state of one rank: python, numpy, torch CPU and every CUDA device.

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
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        saved = state["torch_cuda"]
        if len(saved) != torch.cuda.device_count():
            raise RuntimeError(f"the checkpoint holds RNG state for {len(saved)} CUDA devices, this process "
                               f"sees {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all(saved)


def reseed_rng(seed: int, step: int, rank: int) -> int:
    """The changed-world-size policy: one derived seed for every generator of this rank."""
    derived = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little") >> 1
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # also seeds every CUDA device
    return derived
