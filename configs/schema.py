"""Structured config: every key and type the YAML files may set.

Registered in Hydra's ConfigStore as ``trainer_schema``; ``configs/config.yaml`` lists it
first in its defaults, so every group file and command-line override is merged into these
dataclasses: a misspelled key or a wrong type fails at compose time, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from model.config import ModelConfig


@dataclass
class ParallelConfig:
    """Device mesh: world_size = dp_replicate * dp_shard * tp. -1 in dp_shard: fill."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    device: str = "auto"  # auto | cpu | cuda
    collective_timeout_s: float = 600.0  # first step (compile, warm-up) may be slow
    collective_timeout_after_first_step_s: float = 120.0


@dataclass
class DataSourceConfig:
    """One entry of ``data.mixture``: a prepared dataset (or a folder of shards) and its weight."""

    path: str = MISSING
    weight: float = 1.0


@dataclass
class DataConfig:
    """A prepared token file: ``<path>/tokens.bin`` plus ``<path>/meta.json`` (docs/data.md)."""

    path: str = "outputs/data/pydoc-byte"
    # Built by scripts/prepare_data.py; when prepare_if_missing is true, train.py builds
    # it from these sources on first use (each "pydoc", "stdlib", or a .txt/.jsonl path).
    prepare_if_missing: bool = False
    sources: List[str] = field(default_factory=lambda: ["pydoc"])
    tokenizer: str = "byte"  # byte | bpe
    bpe_vocab_size: int = 4096
    # Non-empty: train on these sources, interleaved by weight (data.path is then unused).
    mixture: List[DataSourceConfig] = field(default_factory=list)
    # false: targets right after an EOS are ignored (-100), so no loss crosses documents;
    # attention still spans the packed window either way.
    cross_document_loss: bool = True
    num_workers: int = 0  # dataloader worker processes; 0 loads in the training process
    prefetch_factor: int = 2  # micro-batches each worker keeps ready (num_workers > 0)
    # Resume although the checkpoint's data fingerprint, seed, seq_len or global batch
    # differ (the changes are logged); otherwise such a resume is refused.
    allow_resume_changes: bool = False


@dataclass
class TrainingConfig:
    steps: int = 100
    global_batch_size: int = 8  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    seq_len: int = 128
    mixed_precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + GradScaler)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4  # lr_max: the peak reached at the end of warmup
    lr_min: float = 3e-5
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    implementation: str = "auto"  # auto | fused | foreach | for-loop


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    interval: int = 0  # steps between saves; 0 disables periodic saves
    async_mode: str = "sync"  # sync | async
    keep_last: int = 2
    keep_every: int = 0  # 0: no permanent tier
    resume: str = "auto"  # auto | never | must | <path or step>


@dataclass
class RecoveryConfig:
    halt_on_nonfinite_loss: bool = True


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "llm-trainer"
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    log_interval: int = 1  # steps between per-step log lines (metrics.jsonl gets every step)
    level: str = "INFO"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = False


@dataclass
class Config:
    run_name: str = "default"
    output_root: str = "outputs"
    # Stable across restarts (never a timestamp): a restarted job finds its checkpoints here.
    run_dir: str = "${output_root}/${run_name}"
    seed: int = 1234
    dry_run: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="trainer_schema", node=Config)


__all__ = ["Config", "ModelConfig", "ParallelConfig", "DataConfig", "TrainingConfig",
           "OptimConfig", "CheckpointConfig", "RecoveryConfig", "LoggingConfig", "register",
           "MISSING"]
