"""The logging section checked at start-up (torch-free; trainer/checks.py gathers it)."""

from __future__ import annotations

from configs.checks import Problems
from configs.constants import LOG_LEVELS, WANDB_MODES


def config_problems(cfg, problems: Problems) -> None:
    lg = cfg.logging
    problems.choice("logging.level", str(lg.level).upper(), LOG_LEVELS)
    problems.at_least("logging.log_interval", lg.log_interval, 1)
    problems.choice("logging.wandb.mode", lg.wandb.mode, WANDB_MODES)
    problems.positive("logging.peak_tflops", lg.peak_tflops)
