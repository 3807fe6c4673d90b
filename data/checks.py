"""Data settings checked at start-up, before any file is opened or memory allocated."""

from __future__ import annotations


def check_data_config(data_cfg) -> None:
    """Checks that need no files: run by configs/validate.py before anything is allocated."""
    problems = []
    if data_cfg.num_workers < 0:
        problems.append(f"data.num_workers={data_cfg.num_workers} must be >= 0 (0 loads in the training process)")
    if data_cfg.prefetch_factor < 1:
        problems.append(f"data.prefetch_factor={data_cfg.prefetch_factor} must be >= 1")
    bad = [f"{m.path}: {m.weight}" for m in data_cfg.mixture if not m.weight > 0]
    if bad:
        problems.append(f"data.mixture weights must be positive: {', '.join(bad)}")
    if problems:
        raise ValueError("; ".join(problems))
