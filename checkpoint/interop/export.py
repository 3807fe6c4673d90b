"""Offline reading of a checkpoint's tensors without the training setup (no process group),
and the exports built on it (scripts/export.py).

DCP's metadata gives every tensor's global shape and dtype and where each saved chunk lies,
so ``CheckpointTensors`` rebuilds one whole tensor at a time on one CPU process, whatever
layout wrote it and in either data format (raw bytes or stock DCP's ``torch.save`` items).
Nothing else is loaded: an export reads only the weights' bytes (after ``verify_checkpoint``'s
checksum pass, which streams every file), and holds one tensor at a time (plus the block it
is converting), never the model.

Two exports:
  safetensors  one file, this project's names, the model config in its metadata;
  hf           a Hugging Face Llama folder that ``LlamaForCausalLM.from_pretrained`` loads:
               config.json, generation_config.json (those the weights were imported with come
               back: hf_config.py), safetensors shards of at most
               max_shard_size (model.safetensors.index.json when there are several), HF
               names with the rotary row order of q/k (model/hf.py), and the
               tokenizer files of the data the run trained on (or those a converted folder keeps).

Both write the tensors in the model's own order (its state dict's, from the config on the meta device).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from checkpoint.durable.manifest import Manifest, read_manifest, verify_checkpoint
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.writer import RAW, tensor_bytes
from checkpoint.interop.hf_config import export_config, hf_generation_config
from checkpoint.interop.safetensors_io import SafetensorsFile, TensorSpec
from checkpoint.interop.weight_source import HF_INDEX, HF_SINGLE
from checkpoint.storage import location
from data.tokenizer import BYTE_TOKENIZER_CONFIG, EOS_TEXT, TOKENIZER_CONFIG, TOKENIZER_JSON, byte_tokenizer_json
from model.config import ModelConfig
from model.hf import hf_name, rotary_heads, to_hf_rows
from model.llama import build_model

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CheckpointTensors:
    """The tensors of a committed checkpoint, each rebuilt whole when asked for (one at a time)."""

    def __init__(self, path: Path, verify: bool = True):
        self.path = location(path)  # a folder, or an s3:// checkpoint
        self.manifest: Manifest = verify_checkpoint(self.path) if verify else read_manifest(self.path)
        reader = RawFileReader(self.path)
        metadata = reader.read_metadata()
        self.storage = metadata.storage_data
        self.meta = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}

    def names(self, prefix: str) -> List[str]:
        """Names (without ``prefix``) of the tensors saved under ``prefix`` (e.g. "model.")."""
        found = [k[len(prefix):] for k in self.meta if k.startswith(prefix)]
        if not found:
            kinds = sorted({k.split(".")[0] for k in self.meta})
            raise KeyError(f"{self.path} has no tensors under '{prefix}' (components: {kinds})")
        return found

    def spec(self, key: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        m = self.meta[key]
        return tuple(m.size), m.properties.dtype

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` (with its prefix), assembled from its saved chunks."""
        md = self.meta[key]
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            info = self.storage[MetadataIndex(key, chunk.offsets)]
            region = out
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, o, n)
            with location(self.path / info.relative_path).open("rb") as f:
                f.seek(info.offset)
                if list(info.transform_descriptors or ()) == [RAW]:
                    target = region if region.is_contiguous() else torch.empty(tuple(chunk.sizes), dtype=out.dtype)
                    mv = tensor_bytes(target)
                    if f.readinto(mv) != len(mv):
                        raise OSError(f"{self.path / info.relative_path}: ends inside {key}")
                    if target is not region:
                        region.copy_(target)
                else:  # stock DCP: a torch.save archive per chunk
                    region.copy_(torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True))
        return out


def load_tensors(path: Path, prefix: str = "model.", verify: bool = True) -> Dict[str, torch.Tensor]:
    """{name without prefix: full tensor} for every saved tensor whose key starts with ``prefix``
    (all of them in memory at once: for tests and small models; exports stream instead)."""
    ckpt = CheckpointTensors(path, verify)
    return {name: ckpt.read(prefix + name) for name in ckpt.names(prefix)}


def model_config_of(manifest: Manifest) -> ModelConfig:
    saved = manifest.config.get("model", {})
    return ModelConfig(**{k: v for k, v in saved.items() if k in ModelConfig.__dataclass_fields__})


def in_model_order(names: List[str], cfg: ModelConfig) -> List[str]:
    """``names`` in the order of the model's state dict (the model built on the meta device: no memory)."""
    order = {name: i for i, name in enumerate(build_model(cfg, materialize=False).state_dict())}
    return sorted(names, key=lambda name: (order.get(name, len(order)), name))


# -- --format safetensors ------------------------------------------------------------------
def export_safetensors(checkpoint: Path, out: Path, dtype: str = "fp32", weights: str = "model",
                       torch_save: Optional[Path] = None, verify: bool = True) -> dict:
    """One safetensors file with this project's names (tied weights written under both names)."""
    ckpt = CheckpointTensors(checkpoint, verify)
    names = in_model_order(ckpt.names(f"{weights}."), model_config_of(ckpt.manifest))
    target = DTYPES[dtype]
    specs = [TensorSpec(n, ckpt.spec(f"{weights}.{n}")[0], target) for n in names]
    meta = {"step": str(ckpt.manifest.step), "config_hash": ckpt.manifest.config_hash, "weights": weights,
            "dtype": dtype, "source": str(location(checkpoint).resolve()),
            "model": json.dumps(ckpt.manifest.config.get("model", {}))}
    out.parent.mkdir(parents=True, exist_ok=True)
    f = SafetensorsFile(out, specs, meta)
    for n in names:
        f.write(n, ckpt.read(f"{weights}.{n}"))
    f.close()
    if torch_save is not None:  # torch.save needs every tensor at once
        torch_save.parent.mkdir(parents=True, exist_ok=True)
        torch.save({n: ckpt.read(f"{weights}.{n}").to(target) for n in names}, torch_save)
    return {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs), **meta}


# -- --format hf -----------------------------------------------------------------------------
def shard_specs(specs: List[TensorSpec], max_bytes: int) -> List[List[TensorSpec]]:
    """Consecutive tensors packed into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def export_hf(checkpoint: Path, out_dir: Path, dtype: str = "fp32", weights: str = "model",
              max_shard_size: int = 5 * 10**9, verify: bool = True,
              tokenizer: Optional[Path] = None) -> dict:
    """A Hugging Face Llama folder at ``out_dir`` (written beside it, then renamed into place)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; export into a new folder")
    ckpt = CheckpointTensors(checkpoint, verify)
    cfg = model_config_of(ckpt.manifest)
    prefix, target = f"{weights}.", DTYPES[dtype]
    ours: Dict[str, str] = {}  # HF name -> ours; names sharing one HF tensor (tied weights) write it once
    for n in in_model_order(ckpt.names(prefix), cfg):
        ours.setdefault(hf_name(n, cfg), n)
    specs = [TensorSpec(theirs, ckpt.spec(prefix + n)[0], target) for theirs, n in ours.items()]
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards = shard_specs(specs, max_shard_size)
        files = [HF_SINGLE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for file, shard in zip(files, shards):
            f = SafetensorsFile(tmp / file, shard, {"format": "pt"})
            for spec in shard:
                name = ours[spec.name]
                t = ckpt.read(prefix + name)
                heads = rotary_heads(name, cfg)
                f.write(spec.name, to_hf_rows(t, heads) if heads else t)
                del t
            f.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                     "weight_map": {s.name: file for file, shard in zip(files, shards) for s in shard}}
            (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        kept = _kept_tokenizer(ckpt, tmp) if tokenizer is None else None  # a converted folder's own, if any
        data = kept or _data_meta(ckpt.manifest, tokenizer)
        record = ckpt.manifest.init_from or {}  # the files the weights came with (init_from.py records them)
        imported = record.get("hf_config")
        eos, bos = data.get("eos_id"), _bos_id(data)
        config = export_config(cfg, HF_DTYPE_NAMES[target], eos, bos, imported)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = hf_generation_config(config, config.get("pad_token_id") if imported else eos,
                                          record.get("hf_generation_config"))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer_note = f"hf tokenizer kept in {checkpoint}" if kept else _write_tokenizer(tmp, data, cfg)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs), "shards": len(shards),
            "step": ckpt.manifest.step, "tokenizer": tokenizer_note}


def _kept_tokenizer(ckpt: CheckpointTensors, out: Path) -> Optional[Dict]:
    """The tokenizer files a checkpoint converted from a Hugging Face folder keeps (listed in its manifest,
    checksummed with it: checkpoint/interop/from_hf.py), copied into ``out``; what _data_meta gives for
    them, or None when the checkpoint keeps none."""
    names = [n for n in (TOKENIZER_JSON, TOKENIZER_CONFIG) if n in ckpt.manifest.files]
    if TOKENIZER_JSON not in names:
        return None
    for name in names:
        (out / name).write_bytes((ckpt.path / name).read_bytes())
    return {"tokenizer": "hf", "tokenizer_file": str(out / TOKENIZER_JSON), "folder": str(out)}


def _data_meta(manifest: Manifest, tokenizer: Optional[Path]) -> Dict:
    """The prepared data's meta.json (plus its folder) for the tokenizer: ``tokenizer`` (a dataset
    folder or a tokenizer.json), else the run's data.path (or first mixture entry); {} when gone."""
    if tokenizer is not None:
        folder = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
    else:
        data = manifest.config.get("data", {})
        mixture = data.get("mixture") or []
        folder = Path(mixture[0]["path"] if mixture else data.get("path", ""))
        if folder.is_dir() and not (folder / "meta.json").is_file():  # a folder of shards
            shards = sorted(folder.glob("*/meta.json"))
            folder = shards[0].parent if shards else folder
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if tokenizer is not None and Path(tokenizer).is_file():
        meta = {**meta, "tokenizer": meta.get("tokenizer", "hf"), "tokenizer_file": str(tokenizer)}
    return {**meta, "folder": str(folder) if str(folder) not in ("", ".") else ""}


def _bos_id(data: Dict) -> Optional[int]:
    """The tokenizer's beginning-of-text id: the ``bos_token`` of an hf: tokenizer's tokenizer_config.json
    (the byte and BPE tokenizers have none)."""
    if "tokenizer_file" in data:
        path = Path(data["tokenizer_file"])
    elif data.get("folder"):
        path = Path(data["folder"]) / TOKENIZER_JSON
    else:
        return None
    config = path.parent / TOKENIZER_CONFIG
    if not (path.is_file() and config.is_file()):
        return None
    bos = json.loads(config.read_text()).get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if not bos:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).token_to_id(bos)


def _write_tokenizer(out: Path, data: Dict, cfg: ModelConfig) -> str:
    """tokenizer.json and tokenizer_config.json for AutoTokenizer, when the data's tokenizer has them
    (bpe and hf:FILE save one; the byte tokenizer's is generated: data/tokenizer.py's byte_tokenizer_json,
    equal to it on every string, with split_special_tokens in its tokenizer_config.json)."""
    from tokenizers import Tokenizer

    folder = Path(data.get("folder", ""))
    source = Path(data["tokenizer_file"]) if "tokenizer_file" in data else folder / TOKENIZER_JSON
    kind = data.get("tokenizer")
    if kind == "byte":
        byte_tokenizer_json().save(str(out / TOKENIZER_JSON))
    elif source.is_file():
        shutil.copyfile(source, out / TOKENIZER_JSON)
    elif not data.get("folder"):
        return "none (the checkpoint names no data.path; pass --tokenizer DATASET_DIR)"
    else:
        return f"none (no prepared dataset with a tokenizer at {folder}; pass --tokenizer DATASET_DIR)"
    if kind == "hf" and (source.parent / TOKENIZER_CONFIG).is_file():
        shutil.copyfile(source.parent / TOKENIZER_CONFIG, out / TOKENIZER_CONFIG)
    else:
        tok = Tokenizer.from_file(str(out / TOKENIZER_JSON))
        eos = tok.id_to_token(data["eos_id"]) if data.get("eos_id") is not None else EOS_TEXT
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
                  "model_max_length": cfg.max_seq_len, "clean_up_tokenization_spaces": False,
                  **(BYTE_TOKENIZER_CONFIG if kind == "byte" else {})}
        (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return f"{kind} tokenizer from {folder}"
