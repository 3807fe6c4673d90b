"""The full training state as one Stateful object (contract 2).

Tensors (model, optimizer, EMA) come from ``get_state_dict``: each rank holds only its
shards and DCP writes them in parallel, never gathered on one rank. Small Python state
(scheduler, grad scaler, data position, the guards' running statistics, counters, metadata,
RNG) is pickled into one ``bytes`` value per component, so its inner layout can evolve without changing the format.
RNG is per rank (``rng.rank_R``); see checkpoint/state/rng.py for the changed-world-size policy.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict

import torch
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint.state.rng import capture_rng, restore_rng
from training.schedule import apply_config


def pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes) -> Any:
    return pickle.loads(blob)


def rng_key(rank: int) -> str:
    return f"rank_{rank:05d}"


class TrainingState(Stateful):
    """Everything that changes the trajectory; ``state_dict`` is what a checkpoint holds.

    ``optim_config`` (cfg.optim): after a load, the optimizer's hyperparameters and the LR at the
    restored step come from it (training/schedule.py:apply_config), so a resume may change
    the schedule. ``data`` is any object with ``state_dict()``/``load_state_dict()`` (the data pipeline);
    so is ``guards`` (recovery/guards: whether a later step is skipped depends on their
    running statistics); ``scaler`` is the fp16 GradScaler or None; ``ema`` is training.ema.EMA
    or None.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 scaler=None, data=None, ema=None, guards=None, *, optim_config=None, rank: int = 0,
                 world_size: int = 1):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.data, self.ema, self.guards = scaler, data, ema, guards
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
        return names

    def state_dict(self) -> Dict[str, Any]:
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
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore the components present in ``sd`` (the loader decides which were requested)."""
        self.weights_version += 1
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
        if "progress" in sd:
            progress = unpack(sd["progress"])
            self.step, self.tokens, self.samples = progress["step"], progress["tokens"], progress["samples"]
        if "meta" in sd:
            self.meta = unpack(sd["meta"])
        rng = sd.get("rng", {}).get(rng_key(self.rank))
        if rng:
            restore_rng(unpack(rng))


def local_state_bytes(sd: Dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in a state dict (its shards only)."""
    total = 0

    def walk(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            total += local.numel() * local.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)

    walk(sd)
    return total
