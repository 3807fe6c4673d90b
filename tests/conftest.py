"""Shared fixtures: a prepared real-text dataset and real torchrun / train.py launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from metrics.records import read_metrics  # noqa: F401  (tests import it from here)
from tools.runs import debug_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """The default corpus (pydoc topics, byte tokenizer), prepared once per test session."""
    from data.token_file import prepare_token_file

    out = tmp_path_factory.mktemp("data") / "pydoc-byte"
    prepare_token_file(out, ["pydoc"], "byte")
    return out


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["WANDB_MODE"] = env.get("WANDB_MODE", "disabled")
    return env


def run_train(overrides: Sequence[str], nproc: int = 1, timeout: float = 600, check: bool = True,
              extra_env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run train.py with Hydra overrides: plain python for one process, torchrun otherwise."""
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "train.py"), *overrides]
    env = _env()
    env.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc
