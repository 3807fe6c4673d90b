"""The logging section (``logging.*``): log lines, metrics backends, and the MFU's denominator (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from configs.keys import AT_LEAST_1, POSITIVE, key, section

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class WandbConfig:
    mode: str = key("disabled", "disabled | offline | online", choices=("disabled", "offline", "online"))
    project: str = key("llm-trainer", "the wandb project")
    entity: Optional[str] = key(None, "the wandb entity (team); null: the user's")


@dataclass
class LoggingConfig:
    log_interval: int = key(1, "steps between per-step log lines (metrics.jsonl gets every step)", AT_LEAST_1)
    level: str = key("INFO", "the log level", choices=LOG_LEVELS)
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases")
    tensorboard: bool = key(False, "also write TensorBoard event files")
    peak_tflops: float = key(989.0, "peak dense TFLOP/s of one device at the training precision, the MFU's "
                             "denominator (docs/training.md has a table; the default: an H100 SXM's bf16)", POSITIVE)
