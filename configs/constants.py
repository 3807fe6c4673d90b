"""The project's shared vocabulary: the valid values of every choice key and the defaults that
several modules need. Torch-free, with no imports from this project, so the config checks
(each package's checks.py, gathered by trainer/checks.py) run before torch is imported and every layer may import it.
"""

from __future__ import annotations

# data/ -> training/: targets with this value carry no loss (PyTorch's cross-entropy default).
IGNORE_INDEX = -100

# training.mixed_precision: autocast dtype; parameters and optimizer state stay fp32.
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "constant")  # optim.schedule
CHECKPOINT_FORMATS = ("raw", "dcp")  # checkpoint.format: raw-bytes data files, or stock DCP's (docs/interop.md)
ASYNC_MODES = ("sync", "async", "async_process")  # checkpoint.async_mode (async_process: DCP's writer process)
BEST_METRICS = ("loss", "probe_loss", "val_loss")  # checkpoint.best_metric (lower is better)
WANDB_MODES = ("disabled", "offline", "online")  # logging.wandb.mode

# recovery.guards.action (recovery/guards/guard.py explains each).
GUARD_ACTIONS = ("log", "skip_step", "block_verified", "rollback")

# Watchdog phases the training loop reports, and their default timeouts in seconds. A phase
# absent from a timeout map uses the "step" timeout.
WATCHDOG_PHASES = ("first_step", "step", "data_wait", "checkpoint_snapshot", "checkpoint_load", "eval",
                   "shutdown")
DEFAULT_TIMEOUTS = {
    "first_step": 600.0,  # compilation, allocator warm-up, first collectives
    "step": 120.0,
    "data_wait": 120.0,
    "checkpoint_snapshot": 300.0,
    "checkpoint_load": 600.0,
    "eval": 600.0,
    "shutdown": 300.0,
}
DEFAULT_WRITE_TIMEOUT_S = 900.0  # a background checkpoint write stuck longer aborts the rank

# recovery.faults (recovery/faults.py): what can be injected, where, and how a checkpoint is damaged.
FAULT_KINDS = ("sigkill", "hang", "exception", "nan_loss", "corrupt", "bitflip_param", "bitflip_grad", "disk_full",
               "node_loss", "slow", "read_error")
SAVE_PHASES = ("checkpoint_snapshot", "checkpoint_write", "checkpoint_commit", "checkpoint_committed")
FAULT_PHASES = ("step", "data_wait", "gradients", "eval") + SAVE_PHASES + ("checkpoint_retention", "checkpoint_load",
                                                                          "checkpoint_read", "manifest_read",
                                                                          "memory_snapshot")
READ_ERROR_PHASES = ("checkpoint_read", "manifest_read")  # a read_error fails a data file's read or a manifest's
CORRUPTIONS = ("truncate", "flip_byte", "delete_file", "delete_manifest")
DISK_FULL_PHASES = ("checkpoint_write", "checkpoint_commit")  # where a disk_full fault raises ENOSPC

# parallel.*
DEVICES = ("auto", "cpu", "cuda")  # parallel.device
PARAM_DTYPES = ("fp32", "bf16")  # parallel.param_dtype and parallel.reduce_dtype
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")  # parallel.activation_checkpoint

OPTIMIZERS = ("adamw",)  # optim.name
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")  # optim.implementation
TOKENIZERS = ("byte", "bpe")  # data.tokenizer
# data.validation, besides the path of a prepared dataset (data/validation.py).
VALIDATION_CHOICES = ("none", "held_out")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # logging.level
ON_SAVE_ERROR = ("stop", "continue")  # checkpoint.on_save_error
RESUME_WORDS = ("auto", "never", "must")  # checkpoint.resume, besides a step number or a checkpoint path
# Set by scripts/torchrun_preemptible.py for its workers once its own config check passed (and printed
# the warnings): train.py and trainer/run.py print no warning again.
CONFIG_CHECKED_ENV = "TRAINER_CONFIG_CHECKED"
# scripts/torchrun_preemptible.py's check of an elastic --nnodes=MIN:MAX: the world sizes of the range,
# comma-separated (trainer/checks.py world_size_of).
CHECK_WORLD_SIZES_ENV = "TRAINER_CHECK_WORLD_SIZES"
