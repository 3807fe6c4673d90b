"""Checks that need more than types: run before anything is allocated, errors name values."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from configs.constants import CORRUPTIONS, FAULT_KINDS, FAULT_PHASES, PRECISIONS, SCHEDULES, WANDB_MODES
from data.checks import check_data_config
from data.tokenizer import check_tokenizer_name
from model.config import ModelConfig


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the values and the fix."""


def model_config(cfg: DictConfig) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))


def fault_problems(fault) -> list:
    """What is wrong with one ``recovery.faults`` entry (a FaultConfig or its DictConfig)."""
    kind, phase = fault.kind, fault.phase
    out = []
    if kind not in FAULT_KINDS:
        out.append(f"recovery.faults: kind={kind!r}: choose one of {list(FAULT_KINDS)}")
    if phase not in FAULT_PHASES:
        out.append(f"recovery.faults: phase={phase!r}: choose one of {list(FAULT_PHASES)}")
    if kind == "corrupt" and fault.corruption not in CORRUPTIONS:
        out.append(f"recovery.faults: corruption={fault.corruption!r}: choose one of {list(CORRUPTIONS)}")
    if kind == "corrupt" and phase != "checkpoint_committed":
        out.append("recovery.faults: a corrupt fault damages a committed checkpoint: use phase=checkpoint_committed")
    if kind == "bitflip_param" and phase != "step":
        out.append("recovery.faults: bitflip_param flips a weight before the forward pass: use phase=step")
    if kind == "bitflip_grad" and phase != "gradients":
        out.append("recovery.faults: bitflip_grad flips a gradient after backward: use phase=gradients")
    if kind.startswith("bitflip") and not 0 <= fault.bit < 32:
        out.append(f"recovery.faults: bit={fault.bit} must be in [0, 32) (an fp32 word)")
    return out


def validate_config(cfg: DictConfig) -> None:
    problems = []

    def check(fn):
        try:
            fn()
        except ValueError as exc:
            problems.append(str(exc))

    check(lambda: model_config(cfg).validate())
    check(lambda: check_tokenizer_name(cfg.data.tokenizer))
    check(lambda: check_data_config(cfg.data))
    t, o = cfg.training, cfg.optim
    if t.steps < 1:
        problems.append(f"training.steps={t.steps} must be >= 1")
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        problems.append(
            f"optim.warmup_steps={o.warmup_steps} is longer than the run (training.steps={t.steps}); "
            f"use at most {t.steps} (typically 1-5% of the steps)"
        )
    if t.seq_len < 1 or t.seq_len > cfg.model.max_seq_len:
        problems.append(
            f"training.seq_len={t.seq_len} is above the model's maximum model.max_seq_len="
            f"{cfg.model.max_seq_len}; lower training.seq_len or raise model.max_seq_len"
        )
    if t.mixed_precision not in PRECISIONS:
        problems.append(f"training.mixed_precision={t.mixed_precision!r}: choose one of {list(PRECISIONS)}")
    if t.grad_clip < 0:
        problems.append(f"training.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if cfg.checkpoint.load_threads < 1:
        problems.append(f"checkpoint.load_threads={cfg.checkpoint.load_threads} must be >= 1 (read streams per "
                        f"rank while loading; 1 reads each file in one sequential stream)")
    if o.schedule not in SCHEDULES:
        problems.append(f"optim.schedule={o.schedule!r}: choose one of {list(SCHEDULES)}")
    if not 0 <= o.lr_min <= o.lr:
        problems.append(f"optim.lr_min={o.lr_min} must be between 0 and optim.lr={o.lr}")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        problems.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r}: choose one of {list(WANDB_MODES)}")
    for fault in cfg.recovery.faults:
        problems += fault_problems(fault)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
