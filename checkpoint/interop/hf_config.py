"""The config.json and generation_config.json an export writes (torch-free).

Fresh weights get the model's own config.json (model/hf.py, which also names the tensors). Weights
that came in from a Hugging Face folder (``model.init_from``, or a converted folder) get back the files
they came with, which the manifest's ``init_from`` record keeps: the publisher's fields (token ids,
sampling defaults, max_position_embeddings) are not the run's to change.
"""

from __future__ import annotations

from typing import Dict, Optional

from model.config import ModelConfig
from model.hf import hf_config

# config.json fields an export writes from the project's own state, whatever came in with the weights: the
# dtype of the exported tensors. Every other field of an imported config.json goes back out unchanged,
# max_position_embeddings too: a run may train at fewer positions (model.max_seq_len), but the rotary
# frequencies do not depend on it (model/rope.py), so the weights still serve every position they did.
OWNED_FIELDS = ("torch_dtype", "dtype")
# generation_config.json's token ids, which an export takes from config.json when no imported
# generation_config.json gives them. An imported one (the publisher's sampling defaults: do_sample,
# temperature, top_p, ...) goes back out unchanged, its ids too: it may list more end-of-text ids than
# config.json does, and generate() stops at those.
GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_config(cfg: ModelConfig, dtype: str, eos_id=None, bos_id=None, imported: Optional[Dict] = None) -> Dict:
    """config.json of an export: the config.json the weights were ``imported`` from with only OWNED_FIELDS
    rewritten (the shape was checked equal at import), else the model's own (model/hf.py)."""
    if imported:
        return {**imported, **{k: dtype for k in OWNED_FIELDS}}
    return hf_config(cfg, dtype, eos_id, bos_id)


def hf_generation_config(config: Dict, pad_id=None, imported: Optional[Dict] = None) -> Dict:
    """generation_config.json beside ``config`` (an export's config.json): the generation_config.json the
    weights were ``imported`` with, unchanged, its GENERATION_IDS that it lacks taken from ``config``
    (``pad_id`` for the pad id)."""
    ids = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
           "pad_token_id": pad_id}
    return {**ids, **(imported or {})}
