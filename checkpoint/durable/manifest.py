"""The manifest: what a committed checkpoint contains and how to check it.

``manifest.json`` is written by the coordinator after every rank acknowledged its files and
before the commit rename, so a committed checkpoint always has one. It lists every data
file with its size and checksum, and the facts recovery needs without loading any tensor:
step, losses (logged, probe and validation), config hash, layout, counters, wall-clock.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

from checkpoint.durable.integrity import atomic_write_text, checksum_file
from checkpoint.durable.layout import MANIFEST

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path and the problem."""


class ConfigMismatch(CheckpointError):
    """The checkpoint was written with settings a resume must not change."""


@dataclass
class FileEntry:
    size: int
    checksum: Optional[str]  # None when checksums were disabled at save


@dataclass
class Manifest:
    checkpoint_id: str
    step: int
    tokens: int
    samples: int
    created_at: float  # wall-clock (unix seconds) when the save was requested
    config_hash: str
    config: Dict  # the resolved config (checkpoint/state/fingerprint.py: which part is hashed, what may change)
    world_size: int
    layout: Dict[str, int]  # dp_replicate, dp_shard, tp
    global_batch_size: int
    loss: Optional[float]  # the training loss logged at this step
    probe_loss: Optional[float]  # loss of the fixed probe batch with these weights (recovery/probe.py)
    checksum_algorithm: Optional[str]
    files: Dict[str, FileEntry] = field(default_factory=dict)
    components: List[str] = field(default_factory=list)  # model, optim, scheduler, rng, ...
    # model.init_from of the run these weights descend from: {path, kind, hash} (checkpoint/interop/init_from.py)
    init_from: Optional[Dict] = None
    format_version: int = FORMAT_VERSION
    # False when a guard (recovery/guards) raised an alarm since the previous save: the state
    # may be corrupt, so rollback and retention do not count this checkpoint as a clean one.
    verified: bool = True
    unverified_reason: Optional[str] = None
    # Validation loss of these weights (training/evaluate.py runs before every save when the run
    # evaluates); None when it does not, or for a save the loop did not plan (preemption).
    val_loss: Optional[float] = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        raw["files"] = {k: FileEntry(**v) for k, v in raw["files"].items()}
        known = {f.name for f in fields(cls)}  # a newer writer's extra fields are ignored
        return cls(**{k: v for k, v in raw.items() if k in known})


def write_manifest(directory: Path, manifest: Manifest) -> None:
    atomic_write_text(Path(directory) / MANIFEST, manifest.to_json())


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST}: not a committed checkpoint")
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from exc


def check_files(directory: Path, manifest: Manifest, names: Optional[List[str]] = None,
                checksums: bool = True) -> List[str]:
    """Problems (missing file, wrong size, checksum mismatch) for ``names`` (default: all files)."""
    problems = []
    for name in names if names is not None else sorted(manifest.files):
        entry = manifest.files[name]
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != entry.size:
            problems.append(f"{name}: {size} bytes, manifest says {entry.size}")
            continue
        if checksums and entry.checksum is not None:
            actual = checksum_file(path, manifest.checksum_algorithm)
            if actual != entry.checksum:
                problems.append(f"{name}: {manifest.checksum_algorithm} {actual}, manifest says {entry.checksum}")
    return problems


def verify_checkpoint(directory: Path, checksums: bool = True) -> Manifest:
    """Read the manifest and check every file; raise CheckpointError naming each problem."""
    manifest = read_manifest(directory)
    problems = check_files(directory, manifest, checksums=checksums)
    if problems:
        raise CheckpointError(f"{directory} is corrupt: " + "; ".join(problems))
    return manifest
