"""The full training state as one Stateful object (contract 2), and each rank's random number generators.

Tensors (model, optimizer, EMA) come from ``get_state_dict``: each rank holds only its shards and DCP
writes them in parallel, never gathered on one rank. Small Python state (scheduler, grad scaler, data
position, the guards' running statistics, counters, metadata, RNG) is pickled into one ``bytes`` value
per component, so its inner layout can change without changing the format.

RNG is per rank (``rng.rank_R``: python, numpy, torch CPU and this rank's CUDA device). At the same world
size every rank restores exactly its own (bitwise continuation); at another there is no meaningful mapping
from old ranks to new ones, so every rank reseeds from (seed, step, rank): the run stays deterministic,
ranks stay decorrelated, and the log says so.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any, Dict

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from training.optimizer import init_state
from training.schedule import apply_config


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


def pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes) -> Any:
    return pickle.loads(blob)


def rng_key(rank: int) -> str:
    return f"rank_{rank:05d}"


class TrainingState(Stateful):
    """Everything that changes the trajectory; ``state_dict`` is what a checkpoint holds. ``data``, ``guards``
    and ``torchft`` (parallel.fault_tolerance: the torchft manager's own state, recovery/fault_tolerance.py) are
    any objects with ``state_dict``/``load_state_dict``; ``scaler`` (fp16), ``ema``, ``guards`` and ``torchft``
    may be None. ``optim_config`` (cfg.optim): after a load the optimizer's hyperparameters and the LR at the
    restored step come from it (training/schedule.py:apply_config), so a resume may change the schedule."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 scaler=None, data=None, ema=None, guards=None, torchft=None, *, optim_config=None, rank: int = 0,
                 world_size: int = 1):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.data, self.ema, self.guards, self.torchft = scaler, data, ema, guards, torchft
        self.optim_config = optim_config
        self.rank, self.world_size = rank, world_size
        self.step = 0  # optimizer steps done
        self.weights_version = 0  # advanced by every step and every load: what the probe's cache keys on
        self.tokens = 0  # target tokens trained on
        self.samples = 0  # sequences trained on
        self.meta: Dict[str, Any] = {}  # set by the checkpoint manager at save time

    def record_step(self, target_tokens: int, samples: int) -> None:
        self.step += 1
        self.weights_version += 1
        self.tokens += int(target_tokens)
        self.samples += int(samples)

    def components(self) -> list:
        names = ["model", "optim", "scheduler", "rng", "progress", "meta"]
        names += ["scaler"] if self.scaler is not None else []
        names += ["data"] if self.data is not None and hasattr(self.data, "state_dict") else []
        names += ["ema"] if self.ema is not None else []
        names += ["guards"] if self.guards is not None else []
        names += ["torchft"] if self.torchft is not None else []
        return names

    def state_dict(self) -> Dict[str, Any]:
        init_state(self.optimizer)  # a load's template: AdamW's state made directly, not by DCP's zero-lr step
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: Dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": pack(self.scheduler.state_dict()),
            "rng": {rng_key(self.rank): pack(capture_rng())},
            "progress": pack({"step": self.step, "tokens": self.tokens, "samples": self.samples}),
            "meta": pack(self.meta),
        }
        if self.scaler is not None:
            sd["scaler"] = pack(self.scaler.state_dict())
        if "data" in self.components():
            sd["data"] = pack(self.data.state_dict())
        if self.ema is not None:
            sd["ema"] = self.ema.state_dict()
        if self.guards is not None:
            sd["guards"] = pack(self.guards.state_dict())
        if self.torchft is not None:
            sd["torchft"] = pack(self.torchft.state_dict())
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore the components present in ``sd`` (the loader decides which were requested)."""
        self.weights_version += 1
        if "optim" in sd:
            init_state(self.optimizer)
        if "model" in sd and "optim" in sd:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        elif "model" in sd:
            set_model_state_dict(self.model, sd["model"])
        elif "optim" in sd:
            set_optimizer_state_dict(self.model, self.optimizer, sd["optim"])
        if "scheduler" in sd:
            self.scheduler.load_state_dict(unpack(sd["scheduler"]))
        if self.optim_config is not None and ("optim" in sd or "scheduler" in sd):
            apply_config(self.optimizer, self.scheduler, self.optim_config)
        if "scaler" in sd and self.scaler is not None:
            self.scaler.load_state_dict(unpack(sd["scaler"]))
        if "data" in sd and self.data is not None:
            self.data.load_state_dict(unpack(sd["data"]))
        if "ema" in sd and self.ema is not None:
            self.ema.load_state_dict(sd["ema"])
        if "guards" in sd and self.guards is not None:
            self.guards.load_state_dict(unpack(sd["guards"]))
        if "torchft" in sd and self.torchft is not None:
            self.torchft.load_state_dict(unpack(sd["torchft"]))
        if "progress" in sd:
            progress = unpack(sd["progress"])
            self.step, self.tokens, self.samples = progress["step"], progress["tokens"], progress["samples"]
        if "meta" in sd:
            self.meta = unpack(sd["meta"])
        rng = sd.get("rng", {}).get(rng_key(self.rank))
        if rng:
            restore_rng(unpack(rng))

