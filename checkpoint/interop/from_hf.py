"""A Hugging Face Llama folder as a committed step-0 checkpoint (scripts/convert_checkpoint.py --to raw|dcp).

Fine-tuning needs no conversion (``model.init_from=FOLDER`` reads the folder directly); this
writes the folder's weights once in the project's format, exactly: every tensor is the folder's
(upcast to the fp32 the model trains in, which is exact for bf16 and fp16; the query and key rows put
back in Meta's rotary order, model/hf.py), so an export of the result gives the folder's tensors bit for bit.

It streams: one tensor is read from safetensors (``get_tensor`` of that name only), converted and
appended to the data file, then dropped, so memory is O(largest tensor) whatever the model's size.
The checkpoint is layout-free: one data file holding every tensor whole (world size 1, one chunk
per tensor), which DCP reshards to any layout at load. It holds the model only (components
["model"], step 0): ``model.init_from=DST`` starts a run from it with a fresh optimizer. Its
manifest records the source as ``init_from`` (with the folder's config.json and
generation_config.json, which an export writes back unchanged) and checksums every file, so the
loaders verify it like any checkpoint.

The folder's tokenizer (``TOKENIZER_FILES``: tokenizer.json and tokenizer_config.json, which names its
end-of-text token) is copied into the checkpoint and listed in its manifest, so that scripts/generate.py
DST needs no flag and an export gives it back. A copy, not a reference to the folder: a downloaded
folder is often moved or deleted once converted, and a copy is checksummed with the weights it belongs
to; it costs a few MB (Llama 3's tokenizer.json is 9 MB) beside GBs of weights.
"""

from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.durable.manifest import FileEntry, Manifest, checksum_file, default_algorithm
from checkpoint.durable.saver import commit_checkpoint
from checkpoint.durable.writer import RAW, tensor_bytes
from checkpoint.interop.init_from import source_hash
from checkpoint.interop.weight_source import SourceError, open_source
from checkpoint.state.fingerprint import config_hash, hashed_config
from checkpoint.storage import location
from checkpoint.storage.dcp import write_metadata
from data.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON
from model.config import ModelConfig
from model.hf import from_hf_rows, hf_name, hf_shape_problems, model_keys_from_hf, rotary_heads
from model.llama import build_model
from parallel.dims import ParallelDims

DATA_FILE, METADATA = "__0_0.distcp", ".metadata"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG)  # a folder's tokenizer, kept in its conversion


def folder_model_config(path: Path) -> ModelConfig:
    """The ModelConfig of the Llama in HF folder ``path`` (what ``model=hf`` fills), checked."""
    source = open_source(path)
    if source.kind != "hf":
        raise SourceError(f"{path}: a Hugging Face Llama folder (config.json + safetensors) is expected here")
    cfg = ModelConfig(name=Path(path).name, **model_keys_from_hf(source.config))
    cfg.validate()
    problems = hf_shape_problems(cfg, source.config, str(path))
    if problems:
        raise SourceError("; ".join(problems))
    return cfg


def hf_tensors(path: Path, cfg: ModelConfig, names: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(our name, fp32 tensor in Meta's q/k row order) for each of ``names``, read one at a time from the
    folder's safetensors (tied weights read the one tensor HF keeps)."""
    from safetensors import safe_open

    source = open_source(path)
    for name in names:
        theirs = hf_name(name, cfg)
        if theirs not in source.tensors:
            raise SourceError(f"{path} lacks {theirs} (for {name})")
        with safe_open(str(source.tensors[theirs][0]), "pt") as f:
            t = f.get_tensor(theirs).float()
        heads = rotary_heads(name, cfg)
        yield name, (from_hf_rows(t, heads) if heads else t).contiguous()


def convert_hf_folder(src: Path, dst: Path, fmt: str = "raw") -> Dict:
    """Write ``dst`` (a new directory) holding HF folder ``src``'s weights as a committed step-0 checkpoint."""
    src, dst = Path(src), location(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; convert into a new directory")
    cfg = folder_model_config(src)
    source = open_source(src)
    names = list(build_model(cfg, materialize=False).state_dict())  # ours, in the model's order (meta: no memory)
    state_meta, storage, planner = {}, {}, {}
    try:  # the commit protocol's order: the data file, .metadata, the manifest last
        with (dst / DATA_FILE).open("wb") as out:
            offset = 0
            for name, t in hf_tensors(src, cfg, names):
                fqn = f"model.{name}"
                if fmt == "raw":
                    blob, descriptors = tensor_bytes(t), [RAW]
                else:  # stock DCP: a torch.save archive per tensor, what FileSystemWriter writes
                    buf = io.BytesIO()
                    torch.save(t, buf)
                    blob, descriptors = buf.getbuffer(), None
                out.write(blob)
                info = _StorageInfo(DATA_FILE, offset, len(blob), descriptors)
                offset += len(blob)
                zeros = torch.Size([0] * t.dim())
                state_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape,
                                                        [ChunkStorageMetadata(zeros, t.shape)])
                storage[MetadataIndex(fqn, zeros)] = info
                planner[fqn] = ("model", name)
                del t, blob
        kept = [n for n in TOKENIZER_FILES if (src / TOKENIZER_JSON).is_file() and (src / n).is_file()]
        for name in kept:
            (dst / name).write_bytes((src / name).read_bytes())
        write_metadata(dst, Metadata(state_meta, planner, storage, StorageMeta()))
        algorithm = default_algorithm()
        files = {n: FileEntry((dst / n).stat().st_size, checksum_file(dst / n, algorithm))
                 for n in (DATA_FILE, METADATA, *kept)}
        config = {"model": dataclasses.asdict(cfg)}
        record = {"path": str(src.resolve()), "kind": "hf", "hash": source_hash(source), "hf_config": source.config}
        if source.generation_config:
            record["hf_generation_config"] = source.generation_config
        manifest = Manifest("step_00000000", 0, 0, 0, time.time(), config_hash(hashed_config(config)), config, 1,
                            ParallelDims(1, 1, 1, 1).layout, 0, None, None, algorithm, files,
                            components=["model"], init_from=record)
        commit_checkpoint(dst, manifest)
    except BaseException:
        dst.rmtree()  # never committed: nothing half-converted is left
        raise
    return {"tensors": len(names), "bytes": files[DATA_FILE].size, "format": fmt, "model": cfg, "tokenizer": kept}
