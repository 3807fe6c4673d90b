"""The Hugging Face Llama vocabulary: config.json fields and tensor names (torch-free).

``transformers.LlamaForCausalLM`` is the same decoder as model/llama.py under other names:

  ours (Meta's names)                        Hugging Face
  tok_embeddings.weight                      model.embed_tokens.weight
  layers.N.attention.wq / wk / wv / wo       model.layers.N.self_attn.q_proj / k_proj / v_proj / o_proj
  layers.N.feed_forward.w1 / w3 / w2         model.layers.N.mlp.gate_proj / up_proj / down_proj
  layers.N.attention_norm / ffn_norm         model.layers.N.input_layernorm / post_attention_layernorm
  norm.weight                                model.norm.weight
  output.weight                              lm_head.weight (absent when tie_word_embeddings)

The rows of wq and wk are also permuted within each head: Meta's rotary embedding turns
consecutive pairs (2j, 2j+1), Hugging Face's turns (j, j + head_dim/2) (checkpoint/interop/hf_weights.py).
checkpoint/checks.py uses this module to compare model.init_from's shape with model.* before
anything is allocated, so it imports no torch.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from model.config import ModelConfig

HF_ARCHITECTURE = "LlamaForCausalLM"

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
    """Our parameter name -> its Hugging Face name."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"{name}: no Hugging Face Llama name for this tensor")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def rotary_heads(name: str, cfg: ModelConfig) -> Optional[int]:
    """The head count whose rows are permuted between the two rotary conventions (wq: n_heads,
    wk: kv_heads), or None for tensors that are the same in both."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    return None


def hf_config(cfg: ModelConfig, dtype: str, eos_id: Optional[int] = None, bos_id: Optional[int] = None) -> Dict:
    """config.json for ``cfg``: every field LlamaForCausalLM reads, in the spelling of transformers 4
    (``rope_theta``, ``torch_dtype``) and 5 (``rope_parameters``, ``dtype``)."""
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
    }


def _rope(hf: Dict) -> tuple:
    """(rope_theta, rope_type) from either spelling of config.json."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), params.get("rope_type", params.get("type", "default"))


def hf_shape_problems(cfg: ModelConfig, hf: Dict, where: str) -> List[str]:
    """Why the weights described by Hugging Face config.json ``hf`` cannot be model.* ``cfg``;
    each problem names our key, its value, and the folder's field and value."""
    if hf.get("model_type") != "llama" and HF_ARCHITECTURE not in hf.get("architectures", []):
        return [f"{where} is not a Llama model (model_type={hf.get('model_type')!r}, architectures="
                f"{hf.get('architectures')}); model.init_from reads LlamaForCausalLM folders"]
    heads = hf.get("num_attention_heads")
    pairs = [
        ("model.dim", cfg.dim, "hidden_size", hf.get("hidden_size")),
        ("model.n_layers", cfg.n_layers, "num_hidden_layers", hf.get("num_hidden_layers")),
        ("model.n_heads", cfg.n_heads, "num_attention_heads", heads),
        ("model.n_kv_heads", cfg.kv_heads, "num_key_value_heads", hf.get("num_key_value_heads") or heads),
        ("model.vocab_size", cfg.vocab_size, "vocab_size", hf.get("vocab_size")),
        ("the FFN width (from model.dim, model.multiple_of, model.ffn_dim_multiplier)", cfg.ffn_hidden_dim,
         "intermediate_size", hf.get("intermediate_size")),
        ("model.tie_embeddings", cfg.tie_embeddings, "tie_word_embeddings", bool(hf.get("tie_word_embeddings"))),
        ("model.norm_eps", cfg.norm_eps, "rms_norm_eps", hf.get("rms_norm_eps")),
        ("model.rope_theta", cfg.rope_theta, "rope_theta", _rope(hf)[0]),
    ]
    if hf.get("head_dim") is not None:
        pairs.append(("the head size model.dim / model.n_heads", cfg.head_dim, "head_dim", hf["head_dim"]))
    problems = [f"{ours}={mine} but {where} has {theirs}={value}" for ours, mine, theirs, value in pairs
                if value != mine]
    rope_type = _rope(hf)[1]
    if rope_type != "default":
        problems.append(f"{where} uses rope_type={rope_type!r} (rotary scaling), which model/llama.py does not "
                        "implement; only plain rotary embeddings (rope_type 'default') can be imported")
    for key, plain in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, plain) != plain:
            problems.append(f"{where} has {key}={hf[key]!r}; model/llama.py is {key}={plain!r}")
    return problems


def project_shape_problems(cfg: ModelConfig, saved: Dict, where: str) -> List[str]:
    """The same check for weights saved by this project (a checkpoint's or an export's model.* config)."""
    theirs = ModelConfig(**{k: v for k, v in saved.items() if k in ModelConfig.__dataclass_fields__})
    derived = {"n_kv_heads": lambda c: c.kv_heads,
               "ffn_hidden_dim": lambda c: c.ffn_hidden_dim}  # multiple_of and ffn_dim_multiplier only size the FFN
    problems = []
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings",
                "norm_eps", "rope_theta"):
        get = derived.get(key, lambda c, k=key: getattr(c, k))
        if get(cfg) != get(theirs):
            name = f"model.{key}" if key != "ffn_hidden_dim" else \
                "the FFN width (from model.dim, model.multiple_of, model.ffn_dim_multiplier)"
            problems.append(f"{name}={get(cfg)} but {where} has {key}={get(theirs)}")
    return problems
