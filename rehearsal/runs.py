"""The small debug runs that tests, rehearsals and benchmarks launch: one definition of their shape."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Union

from omegaconf import OmegaConf

DEBUG_EXPERIMENT = Path(__file__).resolve().parents[1] / "configs" / "experiment" / "debug.yaml"

Extra = Union[Mapping[str, object], Sequence[str], None]


def _as_dict(extra: Extra) -> Dict[str, str]:
    if extra is None:
        return {}
    if isinstance(extra, Mapping):
        return {k: str(v) for k, v in extra.items()}
    out = {}
    for item in extra:  # "key=value" Hydra overrides; the value may itself hold "="
        key, _, value = item.partition("=")
        out[key] = value
    return out


def prepare_debug_data(path: Path) -> Path:
    """The debug experiment's dataset (its sources, tokenizer and held-out validation split) at
    ``path``, built as data.prepare_if_missing would build it; left alone when already there."""
    from data.formats.native import META_FILE
    from data.prep.writer import prepare_token_file

    path = Path(path)
    if not (path / META_FILE).exists():
        data = OmegaConf.load(DEBUG_EXPERIMENT).data
        prepare_token_file(path, list(data.sources), data.tokenizer, validation_fraction=data.validation_fraction)
    return path


def debug_overrides(run_dir: Path, data_dir: Path, steps: int = 8, extra: Extra = None) -> List[str]:
    """A fast debug run writing into ``run_dir`` (absolute) on prepared data in ``data_dir``;
    ``extra`` adds or replaces overrides: {"model.dropout": 0.1} or ["model.dropout=0.1"]."""
    run_dir = Path(run_dir)
    base = {
        "+experiment": "debug",
        "seed": "1234",  # the tests' runs keep the schema's seed (the debug experiment uses 1)
        "output_root": str(run_dir.parent),
        "run_name": run_dir.name,
        "data.path": str(data_dir),
        "data.prepare_if_missing": "false",
        "training.steps": str(steps),
        "training.global_batch_size": "8",
        "training.micro_batch_size": "4",
        "training.seq_len": "64",
        "optim.warmup_steps": "2",
        "checkpoint.interval": "0",
        "logging.log_interval": "1",
    }
    base.update(_as_dict(extra))
    return [f"{k}={v}" for k, v in base.items()]


def tiny_overrides(run_dir: Path, data_dir: Path, steps: int, interval: int, keep_last: int = 2,
                   async_mode: str = "async", extra: Extra = ()) -> List[str]:
    """The rehearsal's run: a debug model small enough that a step takes milliseconds on one
    CPU core, saving every ``interval`` steps."""
    shape = {"training.global_batch_size": 4, "training.micro_batch_size": 2, "training.seq_len": 32,
             "checkpoint.interval": interval, "checkpoint.async_mode": async_mode, "checkpoint.keep_last": keep_last}
    return debug_overrides(run_dir, data_dir, steps, {**_as_dict(shape), **_as_dict(extra)})
