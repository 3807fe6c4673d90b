"""The config hash: which settings a resume must keep, and which it may change.

Hashed: everything that changes the trajectory (model, seed, data, optimizer, schedule,
steps, global batch, precision, EMA, ...). Free to change on resume: the world layout
(``parallel.*``), ``training.micro_batch_size`` (grad accumulation is recomputed, the
global batch is fixed), data loading speed knobs (``data.num_workers``,
``data.prefetch_factor``, ``data.prepare_if_missing``), ``checkpoint.*`` (intervals,
retention, resume), ``logging.*``, ``recovery.*``, and names/paths of the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Dict, List

from omegaconf import DictConfig, OmegaConf

RESUME_MUTABLE = (
    "parallel", "checkpoint", "logging", "recovery", "run_name", "output_root", "run_dir", "dry_run",
    "training.micro_batch_size", "data.num_workers", "data.prefetch_factor", "data.prepare_if_missing",
    # Where the data lives may change; what it is is checked by the data state's fingerprint.
    "data.path", "data.allow_resume_changes",
)


def hashed_config(cfg: DictConfig) -> Dict:
    """The part of the resolved config that a resume must not change."""
    container = copy.deepcopy(OmegaConf.to_container(cfg, resolve=True))
    for dotted in RESUME_MUTABLE:
        node = container
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return container


def config_hash(hashed: Dict) -> str:
    return hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_differences(saved: Dict, current: Dict, prefix: str = "") -> List[str]:
    """'key: saved -> current' for every differing leaf, to say exactly what changed."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out
