"""The run directory: stable across restarts, written by rank 0 only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

from omegaconf import OmegaConf


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_run_config(run_dir: Path, config: Dict[str, Any], overrides: List[str]) -> None:
    """config.yaml (the resolved config, as plain data) and the command-line overrides."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(config))
    _atomic_write(run_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
