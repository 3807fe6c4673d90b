"""The trainer's config composed in the test's own process, as train.py composes it: Hydra over
configs/ with the structured schema registered (no train.py started, so a test stays fast)."""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from configs.schema import register
from helpers.launch import ROOT


def compose(*overrides: str) -> DictConfig:
    """configs/config.yaml with ``overrides`` applied (Hydra's command-line syntax)."""
    register()  # idempotent: the schema the config's defaults name
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose_debug(*overrides: str) -> DictConfig:
    """The debug experiment (``+experiment=debug``) with ``overrides`` applied after it."""
    return compose("+experiment=debug", *overrides)
