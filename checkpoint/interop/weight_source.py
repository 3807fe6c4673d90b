"""What a ``model.init_from`` path holds, read from its small files only (torch-free).

Three kinds of source:
  hf           a Hugging Face Llama folder: config.json plus model.safetensors, or shards
               listed in model.safetensors.index.json (what ``save_pretrained`` and
               ``scripts/export.py --format hf`` write);
  safetensors  one file written by ``scripts/export.py --format safetensors`` (this project's
               names; its metadata holds the model config);
  checkpoint   a committed checkpoint directory (manifest.json); only its model weights are read.

Everything here reads JSON (config.json, the index, a safetensors header, manifest.json), so
checkpoint/checks.py can compare the source's shape with model.* at start-up, before torch is
imported; checkpoint/interop/init_from.py then reads the tensors.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from checkpoint.durable.manifest import MANIFEST, storage_failure
from checkpoint.storage import location
from model.config import ModelConfig
from model.hf import hf_shape_problems, project_shape_problems

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
HF_GENERATION = "generation_config.json"


class SourceError(ValueError):
    """A model.init_from path that cannot be read; the message says what was expected."""


@dataclass
class WeightSource:
    path: Path
    kind: str  # hf | safetensors | checkpoint
    config: Dict  # config.json (hf), or the project's model config (safetensors, checkpoint)
    files: List[Path] = field(default_factory=list)  # the safetensors files (hf, safetensors)
    tensors: Dict[str, Tuple[Path, Dict]] = field(default_factory=dict)  # name -> (file, header entry)
    # generation_config.json the weights came with: the folder's (hf), or the one a checkpoint's weights
    # were imported with (its manifest's init_from); an export writes it back (hf_config.py)
    generation_config: Optional[Dict] = None
    # config.json the weights came with, likewise (the folder's, or a checkpoint's import record's)
    hf_config: Optional[Dict] = None
    # a checkpoint's content hash: of its manifest.json, which holds every file's checksum
    manifest_hash: Optional[str] = None


def read_safetensors_header(path: Path) -> Tuple[Dict[str, Dict], Dict[str, str]]:
    """({tensor name: {dtype, shape, data_offsets}}, __metadata__) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise SourceError(f"{path}: a safetensors header of {n} bytes; the file is not safetensors")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise SourceError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    meta = header.pop("__metadata__", None) or {}
    return header, meta


def _hf(path: Path) -> WeightSource:
    config = json.loads((path / "config.json").read_text())
    if (path / HF_INDEX).is_file():
        weight_map = json.loads((path / HF_INDEX).read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    elif (path / HF_SINGLE).is_file():
        files = [path / HF_SINGLE]
    else:
        found = sorted(p.name for p in path.iterdir())
        raise SourceError(f"model.init_from={path}: a Hugging Face folder needs {HF_SINGLE} or {HF_INDEX} "
                          f"(safetensors; convert .bin weights with save_pretrained(safe_serialization=True)); "
                          f"it holds {found}")
    generation = path / HF_GENERATION
    source = WeightSource(path, "hf", config, files, hf_config=config,
                          generation_config=json.loads(generation.read_text()) if generation.is_file() else None)
    for f in files:
        header, _ = read_safetensors_header(f)
        source.tensors.update({name: (f, entry) for name, entry in header.items()})
    return source


def _export(path: Path) -> WeightSource:
    header, meta = read_safetensors_header(path)
    if "model" not in meta:
        raise SourceError(f"model.init_from={path}: a safetensors file without this project's model config in its "
                          "metadata (write it with scripts/export.py --format safetensors, or pass a Hugging Face "
                          "folder with config.json)")
    source = WeightSource(path, "safetensors", json.loads(meta["model"]), [path])
    source.tensors = {name: (path, entry) for name, entry in header.items()}
    return source


def _checkpoint(path: Path) -> WeightSource:
    text = (path / MANIFEST).read_bytes()
    manifest = json.loads(text)
    model = (manifest.get("config") or {}).get("model")
    if not model:
        raise SourceError(f"model.init_from={path}: its manifest records no model config")
    if "model" not in manifest.get("components", ["model"]):
        raise SourceError(f"model.init_from={path}: the checkpoint holds no model weights "
                          f"(components {manifest.get('components')})")
    imported = manifest.get("init_from") or {}
    return WeightSource(path, "checkpoint", model, generation_config=imported.get("hf_generation_config"),
                        hf_config=imported.get("hf_config"), manifest_hash=hashlib.sha256(text).hexdigest()[:16])


def open_source(path: str | Path) -> WeightSource:
    """The source at ``path``; SourceError says what it expected when ``path`` is none of the three.
    A committed checkpoint may be on any store (checkpoint/storage/); the other two are local files."""
    path = location(path)
    try:
        if path.is_dir() and (path / MANIFEST).is_file():
            return _checkpoint(path)
        if path.local_path() is None:  # a store without local files, holding no committed checkpoint
            raise SourceError(f"model.init_from={path}: on object storage it must be a committed checkpoint "
                              "(step_N with manifest.json); copy a Hugging Face folder or a .safetensors file to a "
                              "local disk first")
        if path.is_dir() and (path / "config.json").is_file():
            return _hf(path)
        if path.is_file() and path.name.endswith(".safetensors"):
            return _export(path)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"model.init_from={path}: unreadable ({type(exc).__name__}: {exc})") from exc
    what = "does not exist" if not path.exists() else "is none of them"
    raise SourceError(f"model.init_from={path} {what}: give a Hugging Face Llama folder (config.json + "
                      "safetensors), a .safetensors file from scripts/export.py, or a committed checkpoint "
                      "directory (step_N with manifest.json)")


def source_problems(cfg: ModelConfig, path: str | Path) -> List[str]:
    """Why model.init_from=``path`` cannot initialise a model of shape ``cfg`` (empty: it can)."""
    return open_checked(cfg, path)[1]


def open_checked(cfg: ModelConfig, path: str | Path) -> Tuple[Optional[WeightSource], List[str]]:
    """(the source, or None if it cannot be opened; why it cannot initialise a model of shape ``cfg``).
    A storage failure (EIO, ESTALE) is raised: read again, it is not a verdict."""
    try:
        source = open_source(path)
    except SourceError as exc:
        if storage_failure(exc) is not None:
            raise
        return None, [str(exc)]
    return source, shape_problems(cfg, source)


def shape_problems(cfg: ModelConfig, source: WeightSource) -> List[str]:
    """Why the opened ``source`` cannot initialise a model of shape ``cfg`` (empty: it can)."""
    if source.kind == "hf":
        return hf_shape_problems(cfg, source.config, str(source.path))
    return project_shape_problems(cfg, source.config, str(source.path))
