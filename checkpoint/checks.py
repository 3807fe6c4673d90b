"""The checkpoint section checked at start-up (torch-free; trainer/checks.py gathers it).

``config_problems`` looks at values only. ``file_problems`` is the part of the pre-flight that
reads files before anything is built: the directory checkpoint.resume names, and the shape of
model.init_from's weights (from their small JSON files) unless the run will resume instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

from checkpoint.durable.discovery import resolve_resume
from checkpoint.durable.layout import MANIFEST
from checkpoint.durable.lease import live_owner
from checkpoint.durable.manifest import CheckpointError, read_manifest
from checkpoint.interop.weight_source import source_problems
from checkpoint.state.fingerprint import config_differences, config_hash, full_config, hashed_config
from checkpoint.storage import location
from configs.checks import ConfigError, Problems
from configs.constants import ASYNC_MODES, BEST_METRICS, CHECKPOINT_FORMATS, ON_SAVE_ERROR, RESUME_WORDS
from model.config import model_config


def parse_interval(value, key: str = "checkpoint.interval") -> int | str:
    """``checkpoint.interval`` (or ``key``): a non-negative step count, or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        steps = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r}: use a step count (0 turns it off) or auto")
    if steps < 0:
        raise ValueError(f"{key}={steps} must be >= 0 (0 turns it off) or auto")
    return steps


def config_problems(cfg, problems: Problems) -> None:
    c = cfg.checkpoint
    problems.check(lambda: parse_interval(c.interval))
    problems.choice("checkpoint.async_mode", c.async_mode, ASYNC_MODES)
    problems.choice("checkpoint.format", c.format, CHECKPOINT_FORMATS)
    problems.at_least("checkpoint.keep_last", c.keep_last, 1,
                      "the newest committed checkpoint is always kept; 0 would keep none")
    problems.at_least("checkpoint.keep_every", c.keep_every, 0, "0 turns the permanent tier off")
    problems.at_least("checkpoint.keep_forensic", c.keep_forensic, 0,
                      "0 deletes BAD, superseded and replaced checkpoints at once")
    problems.at_least("checkpoint.keep_best", c.keep_best, 0, "0 turns the best tier off")
    problems.choice("checkpoint.best_metric", c.best_metric, BEST_METRICS)
    problems.choice("checkpoint.on_save_error", c.on_save_error, ON_SAVE_ERROR)
    problems.at_least("checkpoint.load_threads", c.load_threads, 1,
                      "read streams per rank while loading; 1 reads each file in one sequential stream")
    problems.positive("checkpoint.commit_timeout_s", c.commit_timeout_s)
    m = c.memory
    problems.check(lambda: parse_interval(m.interval, "checkpoint.memory.interval"))
    problems.choice("checkpoint.memory.replicas", m.replicas, (0, 1))
    if m.node is not None:
        problems.at_least("checkpoint.memory.node", m.node, 0, "a node id names root/node-<id>; null: one per host")
    d, e = cfg.data, cfg.eval
    evaluates = str(d.validation).strip() != "none" and e.interval > 0
    if c.best_metric == "val_loss" and c.keep_best > 0 and not evaluates:
        problems.append("checkpoint.best_metric=val_loss ranks checkpoints by their validation loss, but this run "
                        f"does not evaluate (data.validation={d.validation}, eval.interval={e.interval}); set "
                        "data.validation and eval.interval > 0, or choose best_metric loss or probe_loss")


def weights_only_resume(cfg) -> Optional[str]:
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


def config_warnings(cfg) -> List[str]:
    """Settings that work but can never do what they seem to ask (printed, not refused)."""
    c, out = cfg.checkpoint, []
    try:
        interval = parse_interval(c.interval)
    except ValueError:
        return out
    if c.keep_every > 0 and interval != "auto" and interval > 0 and c.keep_every % interval:
        both = math.lcm(c.keep_every, interval)
        when = (f"only steps divisible by {both} are kept" if both <= cfg.training.steps else
                f"no save of this run (training.steps={cfg.training.steps}) is kept, unless the final one")
        out.append(f"checkpoint.keep_every={c.keep_every} is not a multiple of checkpoint.interval={interval}: "
                   f"saves fall on multiples of {interval}, so {when}; set keep_every to a multiple of interval")
    return out


def file_problems(cfg) -> List[str]:
    """checkpoint.resume=<path> holds a committed checkpoint; model.init_from fits model.* (unless
    the run will resume: then its checkpoint's weights win and the source may even be gone)."""
    out: List[str] = []
    resume = str(cfg.checkpoint.resume).strip()
    if resume not in RESUME_WORDS and not resume.isdigit() and not (location(resume) / "manifest.json").is_file():
        out.append(f"checkpoint.resume={resume!r}: use one of {list(RESUME_WORDS)}, a step number, or the "
                   "path of a committed checkpoint directory (one holding manifest.json)")
    if cfg.model.init_from and not cfg.dry_run:
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
    live = None if c.take_over else live_owner(root, c.lease_timeout_s)
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
    if path is None or c.allow_config_change:
        return []
    try:
        saved = read_manifest(path)
    except CheckpointError:  # damaged: the resume's fallback handles it
        return []
    hashed = hashed_config(full_config(cfg))
    if saved.config_hash == config_hash(hashed):
        return []
    diffs = config_differences(hashed_config(saved.config), hashed)
    return [f"checkpoint.resume={c.resume}: {path} was saved with a different config: "
            f"{'; '.join(diffs) or 'unknown fields'}. Resume with the same settings, start another run (run_name), "
            "or set checkpoint.allow_config_change=true to accept the change"]


def _init_from_problems(cfg) -> List[str]:
    try:
        if resolve_resume(location(cfg.checkpoint.dir), str(cfg.checkpoint.resume)) is not None:
            return []
    except CheckpointError:  # the resume itself reports it
        return []
    return source_problems(model_config(cfg), cfg.model.init_from)
