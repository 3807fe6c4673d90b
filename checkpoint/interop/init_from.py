"""``model.init_from``: start a run at step 0 from pretrained weights (fresh optimizer and schedule).

It runs after the model is parallelised and materialised and after the resume: a run that
resumed keeps its checkpoint's weights and says that init_from was ignored. Otherwise every
rank overwrites its own shards in place, through DCP: the planner asks each rank for exactly
the rows and columns its FSDP2 / tensor-parallel shards hold, and

- a Hugging Face folder or this project's safetensors export is read with safetensors'
  ``get_slice`` (checkpoint/interop/safetensors_io.py), HF names and q/k row order translated
  (model/hf.py);
- a committed checkpoint is read by checkpoint/durable/reader.py like a resume, for the ``model``
  component only, its files checksummed while they stream (each rank verifies its share).

No rank holds the full model. The source's kind, path and content hash go into the banner and
into the manifest of every checkpoint the run saves (``Manifest.init_from``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from checkpoint.durable.loader import read_metadata, verification_shares
from checkpoint.durable.manifest import CheckpointError, check_files, checksum_file, default_algorithm, read_manifest
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.reads import READ_RETRIES, READ_RETRY_BACKOFF_S, read_on_rank0
from checkpoint.durable.writer import RAW
from checkpoint.interop.safetensors_io import SafetensorsReader, source_tensors
from checkpoint.interop.weight_source import WeightSource, open_checked
from model.config import ModelConfig
from model.hf import hf_name, rotary_heads
from parallel import collectives

log = logging.getLogger("trainer")
T = TypeVar("T")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple:
    return (dist.get_rank(), dist.get_world_size()) if _dist() else (0, 1)


Reads = Tuple[int, float]  # recovery.read_retries and recovery.read_retry_backoff_s
DEFAULT_READS: Reads = (READ_RETRIES, READ_RETRY_BACKOFF_S)


def _on_rank0(read: Callable[[], T], what: str, reads: Reads) -> T:
    """``read()`` on rank 0 (again while the storage fails, ``reads`` = (retries, backoff)), its answer on
    every rank; a failure is the same CheckpointError on every rank (checkpoint/durable/reads.py)."""
    return read_on_rank0(read, f"model.init_from={what}", *reads, errors=(CheckpointError,))


def source_hash(source: WeightSource, reads: Reads = DEFAULT_READS) -> str:
    """A content hash of the source: a checkpoint's manifest (it holds every file's checksum; hashed
    when rank 0 opened the source), or the checksums of the safetensors files (rank r checksums files
    r, r + world, ...) and config.json. A rank that cannot read its share stops every rank with the
    same error."""
    if source.kind == "checkpoint":
        return source.manifest_hash
    rank, world = _rank_world()
    algorithm = default_algorithm()
    try:
        mine = {str(f.name): (f.stat().st_size, checksum_file(f, algorithm)) for f in source.files[rank::world]}
    except OSError as exc:
        mine = f"rank {rank}: {exc}"
    parts = collectives.all_gather_object(mine)
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise collectives.agreed(CheckpointError(f"model.init_from={source.path}: its files could not be "
                                                 f"checksummed: {'; '.join(failed)}"))  # the same on every rank
    digest = hashlib.sha256(algorithm.encode())
    for name, (size, checksum) in sorted(kv for part in parts for kv in part.items()):
        digest.update(f"{name} {size} {checksum}\n".encode())
    if source.kind == "hf":
        digest.update(_on_rank0(lambda: (source.path / "config.json").read_bytes(), str(source.path), reads))
    return digest.hexdigest()[:16]


def _safetensors_reader(source: WeightSource, keys: List[str], cfg: ModelConfig) -> SafetensorsReader:
    """Our names -> the source's: HF names (q/k rows reordered) for a HF folder, ours for an export."""
    hf = source.kind == "hf"
    names = {key: hf_name(key, cfg) if hf else key for key in keys}
    heads = {key: rotary_heads(key, cfg) for key in keys} if hf else {}
    missing = sorted(f"{theirs} (for {key})" for key, theirs in names.items() if theirs not in source.tensors)
    if missing:
        raise collectives.agreed(CheckpointError(  # the source and the model are the same on every rank
            f"model.init_from={source.path} lacks tensors the model needs: {', '.join(missing)}"))
    return SafetensorsReader(source_tensors(source.tensors, names, heads))


def _checkpoint_reader(path: Path, reads: Reads) -> RawFileReader:
    """A reader that checksums this rank's share of the data files while it streams them (raw
    format), or after checking them up front (stock DCP format, which deserialises)."""
    manifest = _on_rank0(lambda: read_manifest(path), str(path), reads)  # one reader of the small files
    rank, world = _rank_world()
    others, data = verification_shares(manifest, rank, world)
    checksums = manifest.checksum_algorithm is not None
    problems = check_files(path, manifest, others, checksums=checksums) + \
        check_files(path, manifest, sorted(data), checksums=False)
    reader = RawFileReader(path, algorithm=manifest.checksum_algorithm)
    reader._metadata = _on_rank0(lambda: read_metadata(reader), str(path), reads)
    meta = reader.read_metadata()
    raw = all(list(info.transform_descriptors or ()) == [RAW] for idx, info in meta.storage_data.items()
              if isinstance(meta.state_dict_metadata[idx.fqn], TensorStorageMetadata))
    if raw:
        reader.verify = data
    elif not problems:
        problems = check_files(path, manifest, sorted(data), checksums=checksums)
    _refuse_if_any(problems, f"model.init_from={path} failed verification")
    return reader


def _refuse_if_any(problems: List[str], what: str, after: str = "") -> None:
    """Every rank's ``problems`` gathered: the same CheckpointError (marked agreed: printed once) on every
    rank if any rank found one."""
    found = collectives.agree_on_problems("; ".join(problems) or None)
    if found is not None:
        raise collectives.agreed(CheckpointError(f"{what}: {found}{after}"))


@torch.no_grad()
def load_initial_weights(model: torch.nn.Module, source: WeightSource, device: torch.device,
                         reads: Reads = DEFAULT_READS) -> int:
    """Overwrite every rank's shards of ``model`` with ``source``'s weights; the bytes this rank read
    from safetensors files (0 for a checkpoint, whose reads include verification)."""
    sd = get_model_state_dict(model)
    # A parameter under two names (tied weights) is read once: the state dict may hold a copy per name.
    aliases = _aliases(model)
    wanted = {k: v for k, v in sd.items() if k not in aliases}
    if source.kind == "checkpoint":
        reader = _checkpoint_reader(source.path, reads)
        dcp.load({"model": wanted}, storage_reader=reader, no_dist=not _dist())
        _refuse_if_any(reader.problems, f"model.init_from={source.path} failed verification while loading",
                       " (the weights are partly overwritten; the run stops)")
        read = 0
    else:
        reader = _safetensors_reader(source, list(wanted), model.cfg)
        dcp.load(wanted, storage_reader=reader, no_dist=not _dist())
        read = reader.bytes_read
    sd.update({alias: sd[name] for alias, name in aliases.items() if alias in sd})
    set_model_state_dict(model, sd)
    return read


def _aliases(model: torch.nn.Module) -> Dict[str, str]:
    """{second name: first name} of every parameter the model holds under more than one name."""
    first: Dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            aliases[name] = first[id(param)]
    return aliases


def _open_on_rank0(cfg: ModelConfig, init_from: str, reads: Reads) -> WeightSource:
    """The source, opened once and checked against the model on rank 0; every rank gets it (or the same error)."""
    def opened() -> WeightSource:
        source, problems = open_checked(cfg, init_from)
        if problems:
            raise CheckpointError(f"model.init_from={init_from} does not fit the model: " + "; ".join(problems))
        return source
    return _on_rank0(opened, init_from, reads)


def apply_init_from(init_from: Optional[str], state, ckpt, resumed: str, device: torch.device,
                    reads: Reads = DEFAULT_READS) -> str:
    """trainer/run.py's one call, right after the resume: load ``init_from`` into a fresh run (and
    restart the EMA from it); returns the banner's resume text, which says what happened. ``reads``:
    (recovery.read_retries, recovery.read_retry_backoff_s) for the reads rank 0 makes for everyone."""
    if not init_from:
        return resumed
    if state.step > 0:
        log.warning("model.init_from=%s ignored: this run resumed from a checkpoint (step %d), whose weights win",
                    init_from, state.step)
        return f"{resumed}; model.init_from ignored (resumed: the checkpoint's weights win)"
    source = _open_on_rank0(state.model.cfg, init_from, reads)
    t0 = time.perf_counter()
    read = load_initial_weights(state.model, source, device, reads)
    state.weights_version += 1
    if state.ema is not None:  # the EMA starts from the weights the run starts from
        state.ema.load_state_dict({n: p.detach() for n, p in state.ema.params.items()})
    digest = source_hash(source, reads)
    record = {"path": str(source.path.resolve()), "kind": source.kind, "hash": digest}
    if source.hf_config:  # the config.json the weights came with: an export writes it back (OWNED_FIELDS aside)
        record["hf_config"] = source.hf_config
    if source.generation_config:  # and its generation_config.json (sampling defaults), written back likewise
        record["hf_generation_config"] = source.generation_config
    ckpt.init_from = record
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e in source.tensors.values())
    share = f"; this rank read {read / 2**20:.2f} of {total / 2**20:.2f} MiB" if total else ""
    log.info("model.init_from: %s weights from %s (hash %s) in %.2f s%s", source.kind, source.path, digest,
             time.perf_counter() - t0, share)
    return f"{resumed}; weights from model.init_from={source.path} ({source.kind}, hash {digest})"
