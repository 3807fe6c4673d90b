"""The checkpoint section (``checkpoint.*``): when and how the training state is saved, kept and loaded;
the memory tier's and the object store's sub-sections are theirs (torch-free). What the files say (the
checkpoint checkpoint.resume names, a live owner of checkpoint.dir) is the pre-flight's (checkpoint/checks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from checkpoint.memory.config import MemoryTierConfig  # unit: memory
from checkpoint.storage.s3.config import S3Config  # unit: s3
from configs.keys import AT_LEAST_1, MAX_SECONDS, NON_NEGATIVE, SECONDS, Bound, key, section, step_count_or_auto

ASYNC_MODES = ("sync", "async", "async_process")
FORMATS = ["dcp"]  # checkpoint.format: stock DCP's data files, which torch's own readers read
FORMATS.insert(0, "raw")  # unit: raw (tensors as raw bytes, read straight into place: the default)
AUTO_MEASURE_STEPS = 5  # checkpoint.interval=auto (and the memory tier's): the first save, which measures the cost
RESUME_WORDS = ("auto", "never", "must")  # checkpoint.resume, besides a step number or a checkpoint's path
# The attempt lease's heartbeat beats every lease_timeout_s / 4 (checkpoint/durable/lease.py). A beat is a write to
# the checkpoint storage, which can stall for seconds on a shared file system or an object store, and another
# host reads its age against its own clock: below this a live owner looks dead (and the heartbeat spins).
MIN_LEASE_TIMEOUT_S = 10.0


@dataclass
class CheckpointConfig:
    dir: str = key("${run_dir}/checkpoints", "a folder, or s3://bucket/prefix (checkpoint/storage/)")
    interval: str = key("0", "steps between saves (0: no periodic saves), or auto: the Young/Daly interval from the "
                        "measured step time and checkpoint cost (recovery/interval.py)")
    async_mode: str = key("sync", "sync | async (training waits only for the host snapshot; DCP writes in a "
                          "thread) | async_process (written by a writer process of each rank)", choices=ASYNC_MODES)
    format: str = key(FORMATS[0], "raw: tensors as raw bytes, read straight into place | dcp: stock DCP files "
                      "(docs/checkpoint-format.md)", choices=FORMATS)
    save_final: bool = key(True, "also save after the last step (when interval > 0)")
    keep_last: int = key(2, "rolling tier: the newest committed checkpoints kept",
                         AT_LEAST_1.because("the newest committed checkpoint is always kept; 0 would keep none"))
    keep_every: int = key(0, "permanent tier: steps divisible by this are never deleted; 0: off", NON_NEGATIVE)
    keep_forensic: int = key(1, "BAD, superseded and replaced checkpoints kept for people (newest first)",
                             NON_NEGATIVE)
    keep_best: int = key(0, "milestone tier: the N best by best_metric are kept; 0: off", NON_NEGATIVE)
    best_metric: str = key("loss", "lower is better", choices=("loss", "probe_loss", "val_loss"))
    resume: str = key("auto", "auto | never | must | a step number | a checkpoint's path")
    allow_config_change: bool = key(False, "resume although the config hash differs (logged)")
    checksum: bool = key(True, "checksum every file at save (xxh3-64, or crc32 without xxhash)")
    verify_on_load: bool = key(True, "check sizes first, checksums while loading (checkpoint/durable/loader.py)")
    load_threads: int = key(2, "read streams per rank and file while loading (1: one sequential stream)",
                            Bound(1, 256))
    commit_timeout_s: float = key(600.0, "a rank that has not acknowledged a save by then: not committed", SECONDS)
    lease_timeout_s: float = key(
        60.0, "the attempt lease's heartbeat (checkpoint/durable/lease.py): a launch into a directory whose owner "
        "beat less than this ago is refused (another run is live there), unless take_over=true",
        Bound(MIN_LEASE_TIMEOUT_S, MAX_SECONDS, why=(
            f"the heartbeat beats every lease_timeout_s / 4; a beat must outlast a slow write to shared storage and "
            f"clock skew between hosts: use >= {MIN_LEASE_TIMEOUT_S:g} s, e.g. the default 60")))
    take_over: bool = key(False, "take the directory from a live-looking owner (one known to be gone)")
    on_save_error: str = key("stop", "a save the storage refused (full, read-only, quota): stop (the uncommitted "
                             "folder is removed, the run exits with a message) | continue (an alarm; the next "
                             "interval tries again)", choices=("stop", "continue"))
    memory: MemoryTierConfig = section(MemoryTierConfig, "the in-memory tier")  # unit: memory
    s3: S3Config = section(S3Config, "where an s3:// checkpoint.dir or model.init_from lives")  # unit: s3

    def check(self) -> List[str]:
        try:
            step_count_or_auto(self.interval, "checkpoint.interval")
        except ValueError as exc:
            return [str(exc)]
        return []

    @property
    def every(self) -> int | str:
        """checkpoint.interval as a step count, or "auto"."""
        return step_count_or_auto(self.interval, "checkpoint.interval")
