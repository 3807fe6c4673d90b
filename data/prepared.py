"""A prepared dataset: its description file, the folder name data.prepare_if_missing builds, the
command that prepares one, whether a sharded preparation is finished, and DataError, the error for
data that is missing or does not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

META_FILE = "meta.json"  # a prepared dataset's description (data/token_file.py)
PLAN_FILE = "shards.json"  # the request and the plan of a sharded preparation (data/shard_prep.py)


class DataError(ValueError):
    """Data that is missing or does not fit this run; the message says how to fix it."""


def prepared_name(sources: Sequence[str], tokenizer: str) -> str:
    """The folder name data.prepare_if_missing builds under: "<sources>-<tokenizer>" (pydoc-byte; for
    data.tokenizer=hf:/models/llama3/tokenizer.json, pydoc-hf-llama3)."""
    label = str(tokenizer)
    if label.startswith("hf:"):
        label = "hf-" + Path(label[3:]).parent.name
    return "+".join(Path(str(s)).stem for s in sources) + "-" + label


def prepare_command(path, sources: Sequence[str] = ("pydoc",), tokenizer: str = "byte") -> str:
    names = " ".join(map(str, sources))
    return f"python scripts/prepare_data.py --out {path} --sources {names} --tokenizer {tokenizer}"


def is_prepared(path: Path) -> bool:
    """A prepared dataset, a folder of prepared shards, or token files another engine wrote (data/foreign.py)."""
    from data.foreign import foreign_files

    return (path / META_FILE).is_file() or any(path.glob(f"*/{META_FILE}")) or foreign_files(path)[0] is not None


def unfinished_shards(folder: Path) -> Optional[List[str]]:
    """The shards a sharded preparation at ``folder`` planned but has not put in place (None: no plan)."""
    plan_path = Path(folder) / PLAN_FILE
    if not plan_path.is_file():
        return None
    names = [s["name"] for s in json.loads(plan_path.read_text())["shards"]]
    return [n for n in names if not (Path(folder) / n / META_FILE).is_file()]
