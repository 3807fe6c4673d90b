"""Data settings checked at start-up, before any file is opened or memory allocated."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

META_FILE = "meta.json"  # a prepared dataset's description (data/token_file.py)


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
    """A prepared dataset, or a folder of prepared shards."""
    return (path / META_FILE).is_file() or any(path.glob(f"*/{META_FILE}"))


def data_path_problem(data_cfg) -> Optional[str]:
    """Why ``data.path`` cannot be used (None when it can). prepare_if_missing builds only a folder
    named for its sources and tokenizer, so a mistyped path stops instead of building there."""
    if data_cfg.mixture:
        missing = [m.path for m in data_cfg.mixture if not is_prepared(Path(m.path))]
        return (f"data.mixture: no prepared dataset at {missing}; prepare each with: "
                f"{prepare_command('<path>', data_cfg.sources, data_cfg.tokenizer)}") if missing else None
    path = Path(data_cfg.path)
    if is_prepared(path):
        return None
    name = prepared_name(data_cfg.sources, data_cfg.tokenizer)
    how = f"prepare it with: {prepare_command(path, data_cfg.sources, data_cfg.tokenizer)}"
    if not data_cfg.prepare_if_missing:
        return f"no prepared dataset at data.path={path}; {how}  (or set data.prepare_if_missing=true)"
    if path.name != name:
        return (f"no prepared dataset at data.path={path}, and data.prepare_if_missing builds only a folder named "
                f"for its sources and tokenizer ({name!r}), so that a mistyped path is not filled with "
                f"{list(data_cfg.sources)}. Check the path, or {how}")
    return None


def check_data_config(data_cfg) -> None:
    """Checks that need no files: run by configs/validate.py before anything is allocated."""
    problems = []
    if data_cfg.num_workers < 0:
        problems.append(f"data.num_workers={data_cfg.num_workers} must be >= 0 (0 loads in the training process)")
    if data_cfg.prefetch_factor < 1:
        problems.append(f"data.prefetch_factor={data_cfg.prefetch_factor} must be >= 1")
    bad = [f"{m.path}: {m.weight}" for m in data_cfg.mixture if not m.weight > 0]
    if bad:
        problems.append(f"data.mixture weights must be positive: {', '.join(bad)}")
    if problems:
        raise ValueError("; ".join(problems))
