"""``model=hf``: the model is the one in ``model.init_from``, its shape read from the source (torch-free).

configs/model/hf.yaml leaves every shape key unset (``???``). Before any check, the unset keys are
filled from the source (the checkpoint the run resumes from, if any: a restart needs no folder): a
Hugging Face folder's config.json (hidden size, layers, heads, KV heads,
intermediate size, vocabulary, rope theta and scaling, eps, tying, and max_position_embeddings as
model.max_seq_len), or the model config of a checkpoint or of a scripts/export.py file. Keys set
on the command line are left as they are; the shape check (checkpoint/checks.py) then names every
one that disagrees with the source. Filling the config itself, not a copy, is what lets the
banner, config.yaml, the manifests, the planner and ``dry_run`` all see the folder's shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from checkpoint.durable.discovery import resolve_resume
from checkpoint.durable.manifest import CheckpointError
from checkpoint.interop.weight_source import SourceError, open_source, source_problems
from configs.keys import ConfigError
from model.config import SHAPE_KEYS, ModelConfig
from model.hf import model_keys_from_hf


def unset_model_keys(cfg: DictConfig) -> List[str]:
    """The model.* keys left at ``???`` (configs/model/hf.yaml leaves the shape so)."""
    return [k for k in SHAPE_KEYS if OmegaConf.is_missing(cfg.model, k)]


def source_model_keys(path: str) -> Dict:
    """model.* values of the model at ``path`` (a HF folder, a checkpoint, or an export)."""
    source = open_source(path)
    if source.kind == "hf":
        return model_keys_from_hf(source.config)
    saved = {k: v for k, v in source.config.items() if k in ModelConfig.__dataclass_fields__}
    theirs = ModelConfig(**saved)
    return {**saved, "n_kv_heads": theirs.kv_heads, "intermediate_size": theirs.ffn_hidden_dim}


def _shape_source(cfg: DictConfig) -> Optional[str]:
    """Where the shape comes from: the checkpoint the run will resume from (its weights win, and the
    folder may be gone by a restart), else model.init_from."""
    try:
        resumed = resolve_resume(Path(cfg.checkpoint.dir), str(cfg.checkpoint.resume))
    except CheckpointError:  # the resume itself reports it
        resumed = None
    return str(resumed) if resumed is not None else cfg.model.init_from


def fill_model_shape(cfg: DictConfig) -> List[str]:
    """Fill the unset model.* keys of ``cfg`` from model.init_from (or the checkpoint the run resumes
    from); returns the keys filled."""
    unset = unset_model_keys(cfg)
    if not unset:
        return []
    source = _shape_source(cfg)
    if not source:
        raise ConfigError(f"model.{', model.'.join(unset)} unset: model=hf takes the shape from the weights it "
                          "starts from; add model.init_from=PATH (a Hugging Face Llama folder, a checkpoint or an "
                          "export), or choose a preset (e.g. model=llama3_1_8b)")
    try:
        values = source_model_keys(source)
    except SourceError as exc:
        raise ConfigError(f"model=hf reads the model's shape from model.init_from: {exc}") from exc
    absent = [k for k in unset if values.get(k) is None and k != "rope_scaling"]
    if absent:
        raise ConfigError(f"model=hf: {source} gives no value for model.{', model.'.join(absent)}; "
                          "set them on the command line")
    for key in unset:
        cfg.model[key] = values[key]
    # Keys given on the command line must agree; checked here too, so dry_run (which reads no weights) stops.
    problems = source_problems(ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True)), source)
    if problems:
        raise ConfigError("model=hf: model.* given on the command line disagree with model.init_from (drop them, "
                          "or choose another folder):\n  - " + "\n  - ".join(problems))
    return unset
