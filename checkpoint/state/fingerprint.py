"""The config hash: which settings a resume must keep, and which it may change (RESUME_MUTABLE; the list
and the reasons are in docs/checkpoint-format.md, "Config hash"). The schedule (RESUME_SCHEDULE) is applied
from this run's config at the resumed step (training/schedule.py). The manifest stores the whole resolved
config; the hash covers the hashed part only.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Dict, List

RESUME_SCHEDULE = ("training.steps", "optim.lr", "optim.lr_min", "optim.warmup_steps", "optim.schedule",
                   "optim.weight_decay", "training.grad_clip")
RESUME_MUTABLE = RESUME_SCHEDULE + (
    "model.init_from",  # where the first weights came from: a resumed run keeps its checkpoint's
    "parallel", "checkpoint", "logging", "recovery", "run_name", "output_root", "run_dir", "dry_run", "check_only",
    "training.micro_batch_size", "data.num_workers", "data.prefetch_factor", "data.prepare_if_missing",
    # Where the data lives may change; what it is is checked by the data state's fingerprint.
    "data.path", "data.allow_resume_changes",
    # Evaluation does not change the trajectory (tests/integration/test_evaluate.py shows the losses stay bitwise).
    "eval", "data.validation", "data.validation_fraction",
)

# Model keys added later: hashed only when set, so a checkpoint saved before they existed keeps its hash.
HASHED_WHEN_SET = ("rope_scaling", "intermediate_size")


def hashed_config(config: Dict) -> Dict:
    """The part of a resolved config (as plain data: this run's, or a manifest's stored one) that a resume
    must not change."""
    container = copy.deepcopy(config)
    for dotted in RESUME_MUTABLE:
        node = container
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    model = container.get("model")
    for key in HASHED_WHEN_SET:  # unset, they are the behaviour of checkpoints written before them
        if isinstance(model, dict) and model.get(key) is None:
            model.pop(key, None)
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


def _get(container: Dict, dotted: str):
    node = container
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<absent>"
        node = node[part]
    return node


def schedule_changes(saved: Dict, current: Dict) -> List[str]:
    """'key: saved -> current' for the RESUME_SCHEDULE fields that differ (a manifest written
    before the full config was stored holds none of them: nothing is reported)."""
    out = []
    for key in RESUME_SCHEDULE:
        before, now = _get(saved, key), _get(current, key)
        if before != "<absent>" and before != now:
            out.append(f"{key}: {before!r} -> {now!r}")
    return out
