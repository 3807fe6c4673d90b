"""This project's format, written by scripts/prepare_data.py (data/prep/): a prepared dataset is a
folder with ``tokens.bin`` (flat uint16/uint32 ids) and ``meta.json`` (a ShardMeta: the tokenizer,
vocab size, EOS id, dtype, counts, the sources and the sha256 of ``tokens.bin``, which is the
fingerprint), the tokenizer's ``tokenizer.json`` when it has one, and with a held-out split the
``validation`` sub-folder, a prepared dataset of its own. ``data.path`` names one, or a folder whose
sub-folders are prepared datasets: its shards, in name order.

Completion: a prepared dataset is written in a temporary folder and renamed into place, so a folder
with ``meta.json`` is complete; a sharded preparation records its plan in ``shards.json`` and is read
only when every shard it planned is in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from data.formats.shard import FORMAT_VERSION, MappedShard, ShardMeta
from data.prepared import DataError, prepare_command
from data.tokenizer import BPETokenizer, ByteTokenizer, FileTokenizer

NAME = "prepared"
WHAT = "a prepared dataset (tokens.bin + meta.json) or a folder of them"
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
PLAN_FILE = "shards.json"  # the request and the plan of a sharded preparation (data/prep/shards.py)
VALIDATION_DIR = "validation"  # sub-folder of a prepared dataset holding its held-out documents


def read_meta(path: str | Path) -> ShardMeta:
    path = Path(path)
    meta_path, tokens_path = path / META_FILE, path / TOKENS_FILE
    if not meta_path.is_file() or not tokens_path.is_file():
        raise DataError(
            f"no prepared dataset at {path} (expected {TOKENS_FILE} and {META_FILE}); "
            f"prepare it with: {prepare_command(path)}  (or set data.prepare_if_missing=true)"
        )
    meta = ShardMeta(**json.loads(meta_path.read_text()))
    if meta.format_version != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.format_version}, expected {FORMAT_VERSION}")
    expected = meta.num_tokens * np.dtype(meta.dtype).itemsize
    actual = tokens_path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"{tokens_path} is {actual} bytes but meta.json says {meta.num_tokens} tokens of "
            f"{meta.dtype} ({expected} bytes): the file is truncated or stale; prepare it again"
        )
    return meta


class TokenFile(MappedShard):
    """A prepared dataset as a shard; cheap to open in every worker."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.tokens = self._map()

    @property
    def token_file(self) -> Path:
        return self.path / TOKENS_FILE


def load_tokenizer(path: str | Path):
    """The tokenizer a prepared dataset was made with (meta.json names it; a BPE or a file tokenizer
    is saved beside the tokens)."""
    kind, path = read_meta(path).tokenizer, Path(path)
    if kind == "byte":
        return ByteTokenizer()
    return FileTokenizer.load(path) if kind == "hf" else BPETokenizer.load(path)


def _planned(path: Path) -> Optional[List[str]]:
    """The shard names a sharded preparation at ``path`` planned (None: no plan)."""
    plan = path / PLAN_FILE
    return [s["name"] for s in json.loads(plan.read_text())["shards"]] if plan.is_file() else None


def find(path: Path) -> List[Path]:
    if (path / META_FILE).is_file():
        return [path]
    planned = _planned(path)
    if planned is not None:  # every shard the plan names, in place or not yet (open_shards tells)
        return [path / name for name in planned]
    if not path.is_dir():
        return []
    return sorted(p.parent for p in path.glob(f"*/{META_FILE}") if not p.parent.name.startswith("."))


def open_shards(path: Path, found: List[Path], tokenizer: Optional[str]) -> List[TokenFile]:
    """The shards, when complete; their tokenizer is the one meta.json records (data/setup.py compares
    it with data.tokenizer)."""
    missing = [p.name for p in found if not (p / META_FILE).is_file()]
    if missing:
        raise DataError(f"the preparation of {path} is unfinished: {len(missing)} planned shard(s) are not in place "
                        f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); run the same "
                        "scripts/prepare_data.py command again to finish it")
    return [TokenFile(p) for p in found]
