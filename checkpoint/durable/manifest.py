"""The manifest of a committed checkpoint, the checksums of its files, and a checkpoint's errors.

``manifest.json`` is created last, only if absent: that creation is the commit (checkpoint/durable/saver.py).
It lists every file with its size and checksum, and what recovery needs without loading a tensor: step,
losses, config hash, layout. Checksums are xxh3-64 when ``xxhash`` is importable, else CRC-32; the
manifest names which, so a checkpoint is verified with the algorithm that wrote it.
"""

from __future__ import annotations

import json
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from checkpoint.storage import location

try:
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHUNK = 16 << 20  # bytes read at a time to checksum a file
# ``probe_method`` of a restore that compared every applied tensor with the saved bytes (no probe loss: a
# memory snapshot, checkpoint/memory/snapshot.py); post-load verification then checks step and LR only.
APPLIED_BYTES = "applied-bytes"
# ``probe_method`` of a probe loss taken from the step after an async save (recovery/probe.py says how): the
# mean token loss of global samples ``probe_samples``, filled in by the commit.
NEXT_MICRO_BATCH = "next-step-first-micro-batch"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path and the problem."""


class ConfigMismatch(CheckpointError):
    """The checkpoint was written with settings a resume must not change."""


class NewerFormat(ConfigMismatch):
    """Written by a trainer whose manifest format this checkout does not know: refused, as another config
    is (never marked bad, never skipped for an older checkpoint, which would go back in training)."""


class CheckpointUnreadable(CheckpointError):
    """The storage did not deliver the bytes (an I/O error, a timeout, a read that differed from a
    second read): nothing proves the checkpoint is damaged. Retried, then skipped for this
    attempt; never marked BAD."""


class VerificationFailed(CheckpointError):
    """Loaded, but the post-load check (the probe loss) disagrees with the manifest: damage only
    if a second load disagrees again (one faulty device, or a kernel choice, is not the bytes)."""


# An OSError that a second read would answer the same way: not the storage failing.
LASTING = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


def storage_failure(exc: BaseException) -> Optional[BaseException]:
    """The storage failure behind ``exc`` (itself, or what it was raised from): a CheckpointUnreadable
    or an OSError other than a lasting answer; None when ``exc`` is about something else."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CheckpointUnreadable) or (isinstance(exc, OSError) and not isinstance(exc, LASTING)):
            return exc
        exc = exc.__cause__
    return None


# Ordered for decided_on_rank0 and agreement: a subclass before its base.
LOAD_ERRORS = (NewerFormat, ConfigMismatch, CheckpointUnreadable, VerificationFailed, CheckpointError)
# A file a network file system's attribute cache reports missing, or whose bytes hash wrong,
# is looked at again after this long before it counts as damage.
REREAD_DELAY_S = 1.0


# -- checksums --------------------------------------------------------------------------------------
def default_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hasher(algorithm: str):
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise RuntimeError("this checkpoint was checksummed with xxh3_64 but the xxhash package is not "
                               "installed: pip install xxhash (or set checkpoint.verify_on_load=false)")
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}: expected xxh3_64 or crc32")


def checksum_file(path: Path, algorithm: str) -> str:
    """Checksum of a file's bytes, read in large chunks into one reused buffer."""
    h = hasher(algorithm)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with location(path).open("rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def checksum_files(paths: Iterable[Path], algorithm: str, threads: int = 2) -> Dict[str, str]:
    """{name: checksum}; files are hashed in parallel (reads and hashing release the GIL)."""
    paths = list(paths)
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        sums = list(pool.map(lambda p: checksum_file(p, algorithm), paths))
    return {p.name: s for p, s in zip(paths, sums)}


# -- the manifest -----------------------------------------------------------------------------------
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
    # model.init_from of the run these weights descend from: {path, kind, hash[, hf_config, hf_generation_config]}
    init_from: Optional[Dict] = None
    format_version: int = FORMAT_VERSION
    # False when a guard (recovery/guards) raised an alarm since the previous save: rollback and retention do
    # not count it as a clean checkpoint.
    verified: bool = True
    unverified_reason: Optional[str] = None
    val_loss: Optional[float] = None  # of these weights, when the run evaluates before its saves
    # How and where probe_loss was computed (recovery/probe.py): compared bitwise only with a probe computed the
    # same way on the same kernels; None in manifests written before they were recorded.
    probe_method: Optional[str] = None
    probe_kernels: Optional[Dict] = None
    probe_samples: Optional[List[int]] = None  # [start, count] of the global samples of a NEXT_MICRO_BATCH probe

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        if isinstance(raw, dict) and isinstance(raw.get("format_version"), int) and \
                raw["format_version"] > FORMAT_VERSION:
            return cls._of_newer_format(raw)
        raw["files"] = {k: FileEntry(**v) for k, v in raw["files"].items()}
        known = {f.name for f in fields(cls)}  # a newer writer's extra fields are ignored
        return cls(**{k: v for k, v in raw.items() if k in known})

    @classmethod
    def _of_newer_format(cls, raw: Dict) -> "Manifest":
        """What this checkout can tell of a newer format's manifest, for listings: the folder is committed (never
        removed as a leftover), whatever the new format renamed or added. Fields it lacks take their default, else
        None; its file entries keep only the fields known here. ``read_manifest`` refuses it for any use
        (NewerFormat)."""
        entry = {f.name for f in fields(FileEntry)}
        files = raw.get("files") if isinstance(raw.get("files"), dict) else {}
        out = {f.name: raw[f.name] if f.name in raw else f.default_factory() if f.default_factory is not MISSING
               else None if f.default is MISSING else f.default for f in fields(cls) if f.name != "files"}
        out["files"] = {k: FileEntry(**{n: v.get(n) for n in entry}) for k, v in files.items() if isinstance(v, dict)}
        return cls(**out)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (location(directory) / MANIFEST).write_text(manifest.to_json())


_read_fault: Optional[Callable[[Path], None]] = None  # recovery.faults' manifest_read point


def set_manifest_read_fault(hook: Optional[Callable[[Path], None]]) -> None:
    """``hook(path)`` runs before every read of a manifest in this process (trainer/run.py passes the
    run's fault injector; None removes it); an OSError it raises is the read's."""
    global _read_fault
    _read_fault = hook


def read_manifest(directory: Path, reread_delay_s: float = REREAD_DELAY_S) -> Manifest:
    """The manifest of a committed checkpoint, to load or use. An I/O error raises CheckpointUnreadable; a
    manifest missing twice, ``reread_delay_s`` apart, or that does not parse, CheckpointError; one of a newer
    format, NewerFormat (a listing, ``find_manifest``, still counts that checkpoint as committed: an older
    checkout must not sweep it)."""
    found = find_manifest(directory)
    if found is None:
        time.sleep(reread_delay_s)  # an attribute cache may be behind the commit
        found = find_manifest(directory)
    if found is None:
        raise CheckpointError(f"{directory}: no {MANIFEST}: not a committed checkpoint")
    if found.format_version > FORMAT_VERSION:
        raise NewerFormat(f"{directory} was written by a newer trainer (manifest format {found.format_version}; "
                          f"this checkout reads formats up to {FORMAT_VERSION}). Resume with the checkout that "
                          f"wrote it or a newer one; the checkpoint is left as it is.")
    return found


def find_manifest(directory: Path) -> Optional[Manifest]:
    """The manifest of ``directory``, or None when it has none (one look, as a listing looks): read
    straight away, one request on an object store; errors as ``read_manifest``'s."""
    path = location(directory) / MANIFEST
    try:
        text = path.read_text()
        if _read_fault is not None:  # recovery.faults' manifest_read: the read of a manifest that is there
            _read_fault(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as exc:
        raise CheckpointUnreadable(f"{path}: {exc}") from exc
    try:
        return Manifest.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from exc


def inspect_files(directory: Path, manifest: Manifest, names: Optional[List[str]] = None, checksums: bool = True,
                  reread_delay_s: float = REREAD_DELAY_S) -> Tuple[List[str], List[str]]:
    """(damage, unreadable) for ``names`` (default: all files). Damage is proven: a file missing,
    or hashing wrong when read whole, on two looks ``reread_delay_s`` apart, or of the wrong size.
    Unreadable: an I/O error, or a hash that was right on the second read."""
    names = names if names is not None else sorted(manifest.files)
    damage, unreadable, suspects = [], [], []
    for name in names:
        kind, text = _inspect(location(directory) / name, manifest, name, checksums)
        if kind == "suspect":
            suspects.append(name)
        elif kind is not None:
            (damage if kind == "damage" else unreadable).append(text)
    if suspects:
        time.sleep(reread_delay_s)
        for name in suspects:
            kind, text = _inspect(location(directory) / name, manifest, name, checksums)
            if kind is None:
                unreadable.append(f"{name}: missing or hashing wrong on the first look, intact {reread_delay_s:g} s "
                                  "later (a stale cache or a bad read, not damage)")
            else:
                (unreadable if kind == "unreadable" else damage).append(text)
    return damage, unreadable


def _inspect(path: Path, manifest: Manifest, name: str, checksums: bool) -> Tuple[Optional[str], str]:
    """(None | "suspect" | "damage" | "unreadable", what): one file against its manifest entry."""
    entry = manifest.files[name]
    try:
        try:
            size = path.stat().st_size  # one request on an object store: no look for the file first
        except FileNotFoundError:
            return "suspect", f"{name}: missing"
        if size != entry.size:
            return "damage", f"{name}: {size} bytes, manifest says {entry.size}"
        if checksums and entry.checksum is not None:
            actual = checksum_file(path, manifest.checksum_algorithm)
            if actual != entry.checksum:
                return "suspect", f"{name}: {manifest.checksum_algorithm} {actual}, manifest says {entry.checksum}"
    except OSError as exc:
        return "unreadable", f"{name}: {exc}"
    return None, ""


def check_files(directory: Path, manifest: Manifest, names: Optional[List[str]] = None,
                checksums: bool = True) -> List[str]:
    """Problems (missing file, wrong size, checksum mismatch, I/O error) for ``names`` (default: all)."""
    damage, unreadable = inspect_files(directory, manifest, names, checksums)
    return damage + unreadable


def verify_checkpoint(directory: Path, checksums: bool = True) -> Manifest:
    """Read the manifest and check every file; raise CheckpointError naming each problem."""
    manifest = read_manifest(directory)
    problems = check_files(directory, manifest, checksums=checksums)
    if problems:
        raise CheckpointError(f"{directory} is corrupt: " + "; ".join(problems))
    return manifest
