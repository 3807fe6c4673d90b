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
from typing import Dict, List, Optional, Tuple

from model.config import LLAMA3_ROPE_KEYS, ModelConfig

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


def hf_rope(hf: Dict) -> Tuple[float, Optional[Dict], str]:
    """(rope_theta, model.rope_scaling or None, rope_type) from config.json in transformers 4's spelling
    (``rope_theta`` + ``rope_scaling``) or 5's (``rope_parameters``, which also holds the theta)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None, rope_type
    scaling = {"rope_type": rope_type, **{k: params[k] for k in LLAMA3_ROPE_KEYS if k in params}}
    return theta, scaling, rope_type


def _rope_fields(cfg: ModelConfig) -> Dict:
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    params = {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def hf_config(cfg: ModelConfig, dtype: str, eos_id=None, bos_id=None, imported: Optional[Dict] = None) -> Dict:
    """config.json for ``cfg``: every field LlamaForCausalLM reads, in the spelling of transformers 4
    (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and 5 (``rope_parameters``, ``dtype``). With the
    config.json the weights were ``imported`` from, that file comes back with only OWNED_FIELDS rewritten
    (the shape was checked equal at import; ``max_position_embeddings`` stays the folder's whatever
    ``model.max_seq_len`` the run trained at)."""
    if imported:
        out = dict(imported)
        out.update({k: dtype for k in OWNED_FIELDS})
        return out
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
        **_rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
    }


def hf_generation_config(config: Dict, pad_id=None, imported: Optional[Dict] = None) -> Dict:
    """generation_config.json beside ``config`` (an export's config.json): the generation_config.json the
    weights were ``imported`` with, unchanged, its GENERATION_IDS that it lacks taken from ``config``
    (``pad_id`` for the pad id)."""
    ids = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
           "pad_token_id": pad_id}
    return {**ids, **(imported or {})}


def model_keys_from_hf(hf: Dict) -> Dict:
    """The model.* keys of the model in config.json ``hf`` (``model=hf`` fills them; the shape check
    compares them): the shape, the rotary embedding, eps, tying, and max positions as model.max_seq_len."""
    heads = hf.get("num_attention_heads")
    theta, scaling, _ = hf_rope(hf)
    return {"dim": hf.get("hidden_size"), "n_layers": hf.get("num_hidden_layers"), "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads, "vocab_size": hf.get("vocab_size"),
            "intermediate_size": hf.get("intermediate_size"), "norm_eps": hf.get("rms_norm_eps"),
            "rope_theta": theta, "rope_scaling": scaling, "tie_embeddings": bool(hf.get("tie_word_embeddings")),
            "max_seq_len": hf.get("max_position_embeddings")}


def hf_shape_problems(cfg: ModelConfig, hf: Dict, where: str) -> List[str]:
    """Why the weights described by Hugging Face config.json ``hf`` cannot be model.* ``cfg``;
    each problem names our key, its value, and the folder's field and value."""
    if hf.get("model_type") != "llama" and HF_ARCHITECTURE not in hf.get("architectures", []):
        return [f"{where} is not a Llama model (model_type={hf.get('model_type')!r}, architectures="
                f"{hf.get('architectures')}); model.init_from reads LlamaForCausalLM folders"]
    theirs = model_keys_from_hf(hf)
    ffn = "model.intermediate_size" if cfg.intermediate_size is not None else \
        "the FFN width (set model.intermediate_size, or model.dim, model.multiple_of, model.ffn_dim_multiplier)"
    pairs = [
        ("model.dim", cfg.dim, "hidden_size", theirs["dim"]),
        ("model.n_layers", cfg.n_layers, "num_hidden_layers", theirs["n_layers"]),
        ("model.n_heads", cfg.n_heads, "num_attention_heads", theirs["n_heads"]),
        ("model.n_kv_heads", cfg.kv_heads, "num_key_value_heads", theirs["n_kv_heads"]),
        ("model.vocab_size", cfg.vocab_size, "vocab_size", theirs["vocab_size"]),
        (ffn, cfg.ffn_hidden_dim, "intermediate_size", theirs["intermediate_size"]),
        ("model.tie_embeddings", cfg.tie_embeddings, "tie_word_embeddings", theirs["tie_embeddings"]),
        ("model.norm_eps", cfg.norm_eps, "rms_norm_eps", theirs["norm_eps"]),
        ("model.rope_theta", cfg.rope_theta, "rope_theta", theirs["rope_theta"]),
    ]
    if hf.get("head_dim") is not None:
        pairs.append(("the head size model.dim / model.n_heads", cfg.head_dim, "head_dim", hf["head_dim"]))
    problems = [f"{ours}={mine} but {where} has {theirs}={value}" for ours, mine, theirs, value in pairs
                if value != mine]
    _, scaling, rope_type = hf_rope(hf)
    if rope_type not in ("default", "llama3"):
        problems.append(f"{where} uses rope_type={rope_type!r} (rotary scaling), which model/rope.py does not "
                        "implement; plain rotary embeddings ('default') and Llama 3.1's 'llama3' can be imported")
    elif _plain(scaling) != _plain(cfg.rope_scaling):
        problems.append(f"model.rope_scaling={_plain(cfg.rope_scaling)} but {where} has rope_scaling="
                        f"{_plain(scaling)}")
    for key, plain in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, plain) != plain:
            problems.append(f"{where} has {key}={hf[key]!r}; model/llama.py is {key}={plain!r}")
    return problems


def _plain(scaling: Optional[Dict]) -> Optional[Dict]:
    """Rotary scaling as comparable numbers (``type`` spelled ``rope_type``), or None."""
    if not scaling:
        return None
    return {"rope_type": scaling.get("rope_type", scaling.get("type")),
            **{k: float(scaling[k]) for k in LLAMA3_ROPE_KEYS if k in scaling}}


def project_shape_problems(cfg: ModelConfig, saved: Dict, where: str) -> List[str]:
    """The same check for weights saved by this project (a checkpoint's or an export's model.* config)."""
    theirs = ModelConfig(**{k: v for k, v in saved.items() if k in ModelConfig.__dataclass_fields__})
    derived = {"n_kv_heads": lambda c: c.kv_heads,
               "ffn_hidden_dim": lambda c: c.ffn_hidden_dim}  # multiple_of and ffn_dim_multiplier only size the FFN
    problems = []
    derived["rope_scaling"] = lambda c: _plain(c.rope_scaling)
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings",
                "norm_eps", "rope_theta", "rope_scaling"):
        get = derived.get(key, lambda c, k=key: getattr(c, k))
        if get(cfg) != get(theirs):
            name = f"model.{key}" if key != "ffn_hidden_dim" else \
                "the FFN width (set model.intermediate_size, or model.dim, model.multiple_of, model.ffn_dim_multiplier)"
            problems.append(f"{name}={get(cfg)} but {where} has {key}={get(theirs)}")
    return problems
