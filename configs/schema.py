"""Structured config: every key and type the YAML files may set.

Registered in Hydra's ConfigStore as ``trainer_schema``; ``configs/config.yaml`` lists it
first in its defaults, so every group file and command-line override is merged into these
dataclasses: a misspelled key or a wrong type fails at compose time, before any work.
"""

from __future__ import annotations

import difflib
import functools
import re
import typing
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from configs.constants import DEFAULT_TIMEOUTS, DEFAULT_WRITE_TIMEOUT_S
from model.config import ModelConfig


@dataclass
class ModelSchema(ModelConfig):
    """model.*: ModelConfig's keys, the shape ones without a default. Every preset in configs/model/ sets
    them; configs/model/hf.yaml leaves them unset (``???``) for model.init_from's folder to fill
    (checkpoint/interop/model_shape.py). A default here would win over ``???`` when the preset merges."""

    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = MISSING
    vocab_size: int = MISSING
    intermediate_size: Optional[int] = MISSING
    norm_eps: float = MISSING
    rope_theta: float = MISSING
    rope_scaling: Optional[Dict[str, Any]] = MISSING
    max_seq_len: int = MISSING
    tie_embeddings: bool = MISSING


@dataclass
class ParallelConfig:
    """Device mesh: world_size = dp_replicate * dp_shard * tp. -1 in dp_shard: fill."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    device: str = "auto"  # auto | cpu | cuda
    collective_timeout_s: float = 600.0  # first step (compile, warm-up) may be slow
    collective_timeout_after_first_step_s: float = 120.0
    # FSDP2 (docs/parallelism.md): dtype of the gathered parameters / of the gradient reduction.
    param_dtype: str = "fp32"  # fp32 | bf16 (bf16 on GPU; master weights and optimizer stay fp32)
    reduce_dtype: str = "fp32"  # fp32 | bf16
    reshard_after_forward: bool = True  # false: keep gathered params until backward (more memory)
    cpu_offload: bool = False  # sharded params, grads and optimizer state live in host memory
    grad_sync_every_micro_batch: bool = True  # false: reduce-scatter once per step (holds full grads)
    activation_checkpoint: str = "none"  # none | full | selective (per block)
    compile: bool = False  # torch.compile each block
    # FSDP2 (fully_shard on a size-1 mesh) even with one data-parallel rank, which otherwise runs unwrapped:
    # scripts/gpu_check.py runs FSDP2's mixed-precision path on one GPU this way. A world of 1 then starts a
    # process group of one rank.
    force_fsdp: bool = False
    loss_parallel: bool = False  # tp>1: cross entropy on vocabulary-sharded logits


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
    tokenizer: str = "byte"  # byte | bpe | hf:/path/to/tokenizer.json (a local file); must match the data's
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
    # Validation set (data/validation.py): none | held_out (the documents the preparation kept out
    # of data.path) | the path of a prepared dataset with the same tokenizer. Evaluated per `eval`.
    validation: str = "none"
    # Fraction of documents prepare_if_missing holds out of data.path (data/split.py); 0: none.
    validation_fraction: float = 0.0


@dataclass
class TrainingConfig:
    steps: int = 100
    global_batch_size: int = 8  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    seq_len: int = 128
    mixed_precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + GradScaler)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    ema_decay: float = 0.0  # EMA of the weights (training/ema.py), checkpointed; 0 disables


@dataclass
class EvalConfig:
    """Validation loss (training/evaluate.py) on data.validation; off while data.validation=none."""

    interval: int = 100  # steps between evaluations (also after the last step and before every save); 0: off
    batches: int = 8  # fixed validation batches of training.global_batch_size sequences each


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
class MemoryTierConfig:
    """The in-memory tier (checkpoint/memory/tier.py): node-local snapshots with a peer replica."""

    # Steps between snapshots; 0 turns the tier off; "auto": Young/Daly from the measured snapshot stall.
    interval: str = "0"
    replicas: int = 1  # 0: own node only | 1: also on the peer node (the same local rank, next node)
    root: Optional[str] = None  # a tmpfs directory; null: /dev/shm/<user>/<run_name>
    # Several "nodes" on one host (tests): each gets root/node-<node>. null: one node per host.
    node: Optional[int] = None
    required: bool = True  # false: a pre-flight failure (no room in root) leaves the run on the durable tier


@dataclass
class S3Config:
    """Where an ``s3://`` checkpoint.dir (or model.init_from) lives (checkpoint/storage/s3.py). null:
    boto3's own settings (AWS_ENDPOINT_URL_S3, AWS_REGION); credentials are always boto3's."""

    endpoint_url: Optional[str] = None  # an S3-compatible store: http://minio.internal:9000
    region: Optional[str] = None  # us-east-1
    addressing_style: str = "auto"  # auto | path (http://host/bucket/key) | virtual (http://bucket.host/key)


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    # Steps between saves (0 disables periodic saves), or "auto": the Young/Daly interval from
    # the measured step time and checkpoint cost (recovery/interval.py; logged). A string so
    # that both fit one key; YAML integers are accepted as they are.
    interval: str = "0"
    # sync | async (training waits only for the host snapshot; DCP plans and writes in a thread) |
    # async_process (the same, planned and written by a writer process of each rank: no GIL shared with training)
    async_mode: str = "sync"
    # raw: tensors as raw bytes, read straight into place (the fast load); dcp: stock DCP files that
    # torch.distributed.checkpoint's FileSystemReader and dcp_to_torch_save read (docs/checkpoint-format.md).
    format: str = "raw"  # raw | dcp
    save_final: bool = True  # also save after the last step (when interval > 0)
    keep_last: int = 2  # rolling tier: newest committed checkpoints kept (>= 1)
    keep_every: int = 0  # permanent tier: steps divisible by this are never deleted; 0: off
    keep_forensic: int = 1  # BAD, superseded and replaced checkpoints kept for people (newest first)
    keep_best: int = 0  # milestone tier: the N best by best_metric are kept; 0: off
    best_metric: str = "loss"  # loss | probe_loss | val_loss (lower is better)
    resume: str = "auto"  # auto | never | must | <path or step>
    allow_config_change: bool = False  # resume although the config hash differs (logged)
    checksum: bool = True  # checksum every file at save (xxh3-64, or crc32 without xxhash)
    verify_on_load: bool = True  # check sizes first, checksums while loading (checkpoint/durable/loader.py)
    load_threads: int = 2  # read streams per rank and file while loading (1: one sequential stream)
    commit_timeout_s: float = 600.0  # a rank that has not acknowledged by then: not committed
    # The attempt lease's heartbeat (checkpoint/durable/lease.py): a launch into a directory whose owner beat
    # less than this ago is refused (another run is live there), unless take_over=true. >= 10 s: the heartbeat
    # beats every lease_timeout_s / 4 (configs/bounds.py says why).
    lease_timeout_s: float = 60.0
    take_over: bool = False  # take the directory from a live-looking owner (one known to be gone)
    # A save that fails (disk full, read-only, quota): stop (the uncommitted directory is removed and the
    # run exits with a message) or continue (an alarm in metrics.jsonl; the next interval tries again).
    on_save_error: str = "stop"  # stop | continue
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    s3: S3Config = field(default_factory=S3Config)


@dataclass
class FaultConfig:
    """One injected fault (recovery/faults.py): fires once per run directory (``slow``: every match)."""

    # sigkill | hang | exception | nan_loss | corrupt | bitflip_param | bitflip_grad | disk_full | node_loss | slow
    # | read_error
    kind: str = "sigkill"
    phase: str = "step"  # step | data_wait | gradients | checkpoint_* phases (configs/constants.py: FAULT_PHASES)
    step: int = -1  # 1-based step (for checkpoint phases: the checkpoint's step); -1: any
    rank: int = 0  # -1: every rank
    corruption: str = "flip_byte"  # truncate | flip_byte | delete_file | delete_manifest
    hang_s: float = 3600.0
    bit: int = 30  # bitflip_param | bitflip_grad: which bit of the fp32 word to flip
    param: str = ""  # bitflip_*: the parameter's name ("output.weight"); "": block 0's first matrix
    delay_s: float = 0.05  # slow: seconds added each time it matches (with step=-1: every step, every save)
    times: int = 1  # how many matches fire it (its markers count them); -1: every match (slow always)
    skip: int = 0  # pass over the first this many matches (a step replayed after a rollback is the next)


@dataclass
class GuardsConfig:
    """Silent-corruption and loss-spike guards (recovery/guards/guard.py explains the actions)."""

    enabled: bool = True
    action: str = "skip_step"  # log | skip_step | block_verified | rollback
    warmup_steps: int = 20  # no gradient or loss alarm before this many healthy steps
    grad_norm_multiple: float = 100.0  # a layer's grad norm above this x its running mean alarms (docs/guards.md)
    loss_spike_k: float = 6.0  # loss above median + k x 1.4826 x MAD of the window alarms ...
    loss_spike_rel: float = 0.5  # ... and above median x (1 + rel)
    loss_window: int = 50
    shadow_interval: int = 50  # steps between fixed-batch (probe) forward passes; 0 disables
    shadow_rel: float = 0.25  # shadow loss above its recent median x (1 + rel) alarms
    shadow_window: int = 8
    replica_interval: int = 100  # steps between cross-replica weight fingerprints (dp_replicate > 1)
    max_consecutive_skips: int = 3  # then skip_step escalates to rollback
    max_rollbacks: int = 3  # per process; then stop with an error rather than loop
    rollback_min_age_steps: int = 0  # roll back to a verified checkpoint at least this much older ...
    rollback_prefer_permanent: bool = True  # ... preferring the permanent (keep_every) tier past that age


@dataclass
class RecoveryConfig:
    halt_on_nonfinite_loss: bool = True
    # Watchdog (recovery/watchdog.py): seconds without a heartbeat, per phase, before the
    # rank dumps its stacks and aborts so the launcher restarts the group.
    watchdog: bool = True
    timeouts: Dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIMEOUTS))
    checkpoint_write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a background write stuck longer aborts the rank
    straggler_interval: int = 50  # steps between straggler reports; 0 disables
    straggler_factor: float = 1.5  # a rank slower than factor x the median is named
    # Preemption (recovery/preemption.py): these signals save at the next step boundary and exit.
    preemption_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    preemption_grace_s: float = 120.0
    # Verified resume (recovery/verify.py): probe loss, LR and step checks, fallback.
    verify: bool = True
    probe_rtol_reshard: float = 1e-4  # probe loss tolerance across layouts, devices or kernels (else bitwise)
    max_fallbacks: int = 3  # older checkpoints tried after a failed verification, then stop
    read_retries: int = 3  # a checkpoint the storage failed to deliver (EIO, ESTALE) is loaded again ...
    read_retry_backoff_s: float = 2.0  # ... after 2, 4, 8 s; then skipped for this attempt, never marked BAD
    allow_global_batch_change: bool = False  # resume with a global batch other than the checkpoint's
    device_mtbf_hours: float = 50000.0  # for checkpoint.interval=auto (recovery/interval.py)
    devices: int = 0  # devices in the job for the MTBF; 0: the world size
    faults: List[FaultConfig] = field(default_factory=list)  # fault injection; empty = off
    guards: GuardsConfig = field(default_factory=GuardsConfig)


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
    # Peak dense TFLOP/s of one device at the training precision, the denominator of MFU
    # (docs/training.md has a table); the default is an H100 SXM's bf16 peak.
    peak_tflops: float = 989.0


@dataclass
class Config:
    run_name: str = "default"
    output_root: str = "outputs"
    # Stable across restarts (never a timestamp): a restarted job finds its checkpoints here.
    run_dir: str = "${output_root}/${run_name}"
    seed: int = 1234
    dry_run: bool = False
    # Run every check train.py runs before building anything, print the block, and exit (0: accepted, 2:
    # refused). The launchers in scripts/ run it once before starting the workers.
    check_only: bool = False
    model: ModelSchema = field(default_factory=ModelSchema)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _plain(tp):
    """Optional[X] -> X."""
    if typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


@functools.lru_cache(maxsize=None)
def _hints(tp) -> Dict[str, Any]:
    """A schema dataclass's field types (typing resolves them anew on every call; the checks walk the schema
    for every config)."""
    return typing.get_type_hints(tp)


def _walk(node, tp, prefix: str) -> Iterator[Tuple[str, str, object, object]]:
    """(kind, dotted key, schema type, node) for every key of the composed ``node`` against schema type ``tp``:
    kind "unknown" for a key the schema does not declare, "leaf" for a value; containers are entered."""
    tp = _plain(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_dataclass(tp) and isinstance(node, DictConfig):
        hints = _hints(tp)
        for key in node.keys():
            if key not in hints:
                yield "unknown", f"{prefix}{key}", None, None
            else:
                yield from _walk(node._get_node(key), hints[key], f"{prefix}{key}.")
    elif origin in (list, List) and isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _walk(node._get_node(i), args[0], f"{prefix[:-1]}[{i}].")
    elif origin in (dict, Dict) and isinstance(node, DictConfig):
        for key in node.keys():
            yield from _walk(node._get_node(key), args[1], f"{prefix}{key}.")
    else:
        yield "leaf", prefix[:-1], tp, node


def known_keys(tp=None, prefix: str = "") -> List[str]:
    """Every dotted key the schema declares (``[]`` for a list's items, ``*`` for a mapping's keys)."""
    out = []
    for name, hint in _hints(tp or Config).items():
        hint = _plain(hint)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if is_dataclass(hint):
            out += known_keys(hint, f"{prefix}{name}.")
        elif origin in (list, List) and is_dataclass(args[0]):
            out += known_keys(args[0], f"{prefix}{name}[].")
        elif origin in (dict, Dict):
            out.append(f"{prefix}{name}.*")
        else:
            out.append(f"{prefix}{name}")
    return out


def numeric_keys() -> List[Tuple[str, type]]:
    """(dotted key, int or float) for every number the schema declares, for the checks and their tests."""
    out = []
    for key in known_keys():
        tp = _schema_type(key)
        if tp in (int, float):
            out.append((key, tp))
    return out


def _schema_type(key: str):
    tp = Config
    for part in key.replace("[]", "").split("."):
        tp = _plain(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (list, List):
            tp = _plain(args[0])
        if typing.get_origin(tp) in (dict, Dict):
            tp = typing.get_args(tp)[1]
            continue
        tp = _hints(tp)[part]
    return _plain(tp)


def unknown_key_problems(cfg: DictConfig) -> List[str]:
    """The composed config is closed: a key the schema does not declare (one added with ``+``, which Hydra
    lets through) is an error naming the closest key it does declare."""
    known = [k for k in known_keys() if not k.endswith("*")]
    out = []
    for kind, key, *_ in _walk(cfg, Config, ""):
        if kind == "unknown":
            pattern = re.sub(r"\[\d+\]", "[]", key)
            section = pattern.rsplit(".", 1)[0] if "." in pattern else ""
            siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == section]
            near = (difflib.get_close_matches(pattern, siblings, n=1, cutoff=0.6)
                    or difflib.get_close_matches(pattern, known, n=1, cutoff=0.6))
            hint = f"; did you mean {near[0]}?" if near else ""
            out.append(f"{key}: the schema (configs/schema.py) has no such key{hint} (a key added with + must be "
                       "declared in the schema first)")
    return out


def numeric_values(cfg: DictConfig) -> List[Tuple[str, object]]:
    """(dotted key, value) for every number of the composed config, as the schema types it, resolved; in a
    mapping of any values (model.rope_scaling) the values that are numbers."""
    out = []
    for kind, key, tp, node in _walk(cfg, Config, ""):
        if kind == "leaf" and tp in (int, float, Any):
            resolve = node._is_interpolation() or node._is_missing()  # else the node holds the value itself
            value = OmegaConf.select(cfg, key, throw_on_missing=False) if resolve else node._value()
            if tp is not Any or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                out.append((key, value))
    return out


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="trainer_schema", node=Config)


__all__ = ["Config", "ModelConfig", "ModelSchema", "ParallelConfig", "DataConfig", "TrainingConfig",
           "EvalConfig", "OptimConfig", "CheckpointConfig", "RecoveryConfig", "LoggingConfig", "register",
           "MISSING"]
