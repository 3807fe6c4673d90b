"""The trainer's config composed in the test's own process, as train.py composes it: Hydra over
configs/ with the structured schema registered (no train.py started, so a test stays fast)."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from support.launch import ROOT
from trainer.config import register

# Where a composed config's run and data would be unless a test says: a folder nobody writes. The
# defaults (outputs/, outputs/data/pydoc-byte) are the user's own runs: a check with files=True would
# find `python train.py +experiment=debug`'s checkpoints there and judge them (checkpoint.resume=auto).
# (A name of this process's own: a folder of that name another user or run left would be seen.)
UNUSED = Path(tempfile.gettempdir()) / f"llm-trainer-tests-nothing-here-{uuid.uuid4().hex}"


def compose(*overrides: str) -> DictConfig:
    """configs/config.yaml with ``overrides`` applied (Hydra's command-line syntax), its output_root
    and data.path in an empty place (``UNUSED``) unless ``overrides`` name them (the last value wins)."""
    register()  # idempotent: the schema the config's defaults name
    isolated = [f"output_root={UNUSED}", f"data.path={UNUSED}/data/pydoc-byte"]  # a name prepare_if_missing builds
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[*isolated, *overrides])


def compose_debug(*overrides: str) -> DictConfig:
    """The debug experiment (``+experiment=debug``) with ``overrides`` applied after it."""
    return compose("+experiment=debug", *overrides)
