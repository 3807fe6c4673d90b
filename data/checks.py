"""The data section checked at start-up (torch-free; trainer/checks.py gathers it).

``config_problems`` looks at values only; ``file_problems`` is the part of the pre-flight that
looks at data.path (a prepared dataset, or one prepare_if_missing may build) and the validation
split, before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from configs.checks import Problems
from data.prepared import is_prepared, prepare_command, prepared_name
from data.tokenizer import check_tokenizer_name
from data.validation import validation_problem


def config_problems(cfg, problems: Problems) -> None:
    d = cfg.data
    problems.check(lambda: check_tokenizer_name(d.tokenizer))
    problems.check(lambda: check_data_config(d))
    if not 0 <= d.validation_fraction < 1:
        problems.append(f"data.validation_fraction={d.validation_fraction} must be in [0, 1) (0 holds nothing out)")
    if str(d.validation).strip() == "held_out" and d.prepare_if_missing and not d.validation_fraction > 0:
        problems.append("data.validation=held_out with data.prepare_if_missing=true needs data.validation_fraction > 0 "
                        "(the fraction of documents to hold out, e.g. 0.01)")


def file_problems(cfg) -> List[str]:
    """data.path and data.validation, for a run that trains (not a dry run)."""
    d = cfg.data
    if cfg.dry_run:
        return []
    out = []
    try:  # with an unknown tokenizer (reported already), the advice would name it in a prepare command
        check_tokenizer_name(d.tokenizer)
        problem = data_path_problem(d)
        if problem:
            out.append(problem)
    except ValueError:
        pass
    prepared_yet = not (d.prepare_if_missing and not (Path(d.path) / "meta.json").is_file())
    problem = validation_problem(d, prepared_yet=prepared_yet)
    if problem:
        out.append(problem)
    return out


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
    """Checks that need no files."""
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
