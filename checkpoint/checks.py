"""What the pre-flight (trainer/preflight.py) reads of the checkpoint files before anything is built: the
directory checkpoint.resume names (and whether a live run owns checkpoint.dir), and the shape of
model.init_from's weights (from their small JSON files) unless the run will resume instead. A weights-only
checkpoint.resume becomes model.init_from here, before the config is typed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional

from checkpoint.config import RESUME_WORDS
from checkpoint.durable.discovery import resolve_resume
from checkpoint.durable.lease import group_lease, live_owner
from checkpoint.durable.manifest import MANIFEST, CheckpointError, NewerFormat, read_manifest
from checkpoint.state.fingerprint import config_differences, config_hash, hashed_config
from checkpoint.storage import location
from configs.keys import ConfigError


def weights_only_resume(cfg) -> Optional[str]:  # unit: interop
    """checkpoint.resume=PATH naming a weights-only checkpoint (components [model], e.g. an HF folder
    converted by scripts/convert_checkpoint.py) becomes model.init_from=PATH with checkpoint.resume=auto:
    the run starts at step 0 from those weights with a fresh optimizer, and a restart of it resumes from
    its own checkpoints. Returns what was changed (for the log), or None."""
    resume = str(cfg.checkpoint.resume).strip()
    manifest = location(resume) / MANIFEST
    if resume in RESUME_WORDS or resume.isdigit() or not manifest.is_file():
        return None
    try:
        components = json.loads(manifest.read_text()).get("components") or []
    except ValueError:
        return None  # the resume reports a damaged checkpoint; an OSError is read again (trainer/startup.py)
    if components != ["model"]:
        return None
    if cfg.model.init_from and _place(cfg.model.init_from) != _place(resume):
        raise ConfigError(f"checkpoint.resume={resume} holds model weights only (it starts a run like model.init_from) "
                          f"but model.init_from={cfg.model.init_from} names other weights; give one of them")
    cfg.model.init_from, cfg.checkpoint.resume = resume, "auto"
    return f"checkpoint.resume={resume} holds model weights only: model.init_from={resume}, checkpoint.resume=auto"


def file_problems(cfg) -> List[str]:
    """checkpoint.resume=<path> holds a committed checkpoint; model.init_from fits model.* (unless
    the run will resume: then its checkpoint's weights win and the source may even be gone)."""
    out: List[str] = []
    resume = str(cfg.checkpoint.resume).strip()
    if resume not in RESUME_WORDS and not resume.isdigit() and not (location(resume) / MANIFEST).is_file():
        out.append(f"checkpoint.resume={resume!r}: use one of {list(RESUME_WORDS)}, a step number, or the "
                   "path of a committed checkpoint directory (one holding manifest.json)")
    if cfg.model.init_from and not cfg.dry_run:  # unit: interop
        out += _init_from_problems(cfg)
    if not out and not cfg.dry_run:
        out += resume_problems(cfg)
    return out


def _place(where) -> str:
    """A location compared by name: a local path resolved."""
    return str(location(where).resolve())


def resume_problems(cfg) -> List[str]:
    """Before anything is built or written: no live run owns checkpoint.dir (checkpoint/durable/lease.py),
    checkpoint.resume finds what it asks for, and the checkpoint it will load was saved with this config
    (the hashed part; checkpoint.allow_config_change accepts a difference). Read-only."""
    c, root = cfg.checkpoint, location(cfg.checkpoint.dir)
    lease = root
    if cfg.parallel.fault_tolerance.enabled:  # unit: fault_tolerance (each replica group its own lease)
        lease = group_lease(root, cfg.parallel.fault_tolerance.replica_id)
    live = None if c.take_over else live_owner(lease, c.lease_timeout_s)
    if live:
        return [f"checkpoint.dir: {live}"]
    try:
        path = resolve_resume(root, str(c.resume))
    except CheckpointError as exc:
        fix = ""
        if not root.exists():
            runs = sorted(p.parent.name for p in Path(cfg.output_root).glob("*/checkpoints")) if Path(
                cfg.output_root).is_dir() else []
            fix = (f". {root} does not exist: check checkpoint.dir and run_name for a typo"
                   + (f" (runs with checkpoints under output_root={cfg.output_root}: {runs})" if runs else "")
                   + ", or start fresh with checkpoint.resume=auto")
        return [f"{exc}{fix}"]
    if path is None:
        return []
    try:
        saved = read_manifest(path)
    except NewerFormat as exc:  # no flag allows it
        return [f"checkpoint.resume={c.resume}: {exc}"]
    except CheckpointError:  # damaged: the resume's fallback handles it
        return []
    if c.allow_config_change:
        return []
    hashed = hashed_config(dataclasses.asdict(cfg))
    if saved.config_hash == config_hash(hashed):
        return []
    diffs = config_differences(hashed_config(saved.config), hashed)
    return [f"checkpoint.resume={c.resume}: {path} was saved with a different config: "
            f"{'; '.join(diffs) or 'unknown fields'}. Resume with the same settings, start another run (run_name), "
            "or set checkpoint.allow_config_change=true to accept the change"]


def _init_from_problems(cfg) -> List[str]:  # unit: interop
    try:
        if resolve_resume(location(cfg.checkpoint.dir), str(cfg.checkpoint.resume)) is not None:
            return []
    except CheckpointError:  # the resume itself reports it
        return []
    from checkpoint.interop.weight_source import source_problems  # unit: interop (loaded only for init_from)

    return source_problems(cfg.model, cfg.model.init_from)
