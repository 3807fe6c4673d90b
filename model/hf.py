"""The decoder's Hugging Face adapter: tensor names, the q/k rotary row order, config.json (torch-free).

``transformers.LlamaForCausalLM`` is the same decoder as model/llama.py under other names:

  ours (Meta's names)                        Hugging Face
  tok_embeddings.weight                      model.embed_tokens.weight
  layers.N.attention.wq / wk / wv / wo       model.layers.N.self_attn.q_proj / k_proj / v_proj / o_proj
  layers.N.feed_forward.w1 / w3 / w2         model.layers.N.mlp.gate_proj / up_proj / down_proj
  layers.N.attention_norm / ffn_norm         model.layers.N.input_layernorm / post_attention_layernorm
  norm.weight                                model.norm.weight
  output.weight                              lm_head.weight; with tie_word_embeddings none: the embedding

The rows of wq and wk are also permuted within each head (``to_hf_rows``). checkpoint/interop/ moves
the tensors and reads the files; what they are called and how they are laid out is said here, beside
the model, so a change of the model changes this file and not the interop code. No torch import: the
shape checks run at start-up, before torch is (checkpoint/checks.py); the row permutations only call
methods of the tensors they are given.
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
_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"
_TOP = {_EMBEDDING: "model.embed_tokens.weight", "norm.weight": "model.norm.weight", _OUTPUT: "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}  # config.json fields model/llama.py has


def hf_name(name: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the Hugging Face tensor that holds it. A tied output layer's is the
    embedding's: HF keeps embed_tokens and ties lm_head to it, so an export writes that tensor once
    and an import reads it for both."""
    if name == _OUTPUT and cfg.tie_embeddings:
        name = _EMBEDDING
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


# Within each head of head_dim rows, model/llama.py rotates consecutive pairs: rows (2j, 2j+1) share
# frequency j. Hugging Face's Llama rotates halves: rows (j, j + head_dim/2) share it. The same weights
# in HF's layout are the rows of each head reordered, Meta row 2j + p -> HF row p * head_dim/2 + j
# (p in {0, 1}), the ``permute`` of transformers' convert_llama_weights_to_hf.py. Both directions are a
# reshape and a transpose per head, so a slice of whole heads converts on its own: an import reads only
# the heads a rank holds (checkpoint/interop/safetensors_io.py).
def to_hf_rows(w, heads: int):
    """Meta's row order -> Hugging Face's, for the tensor ``w`` holding ``heads`` whole heads (rows first)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w, heads: int):
    """Hugging Face's row order -> Meta's (the inverse of ``to_hf_rows``)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(w.shape)


# -- config.json --------------------------------------------------------------------------------------
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


def hf_config(cfg: ModelConfig, dtype: str, eos_id=None, bos_id=None) -> Dict:
    """config.json for ``cfg``: every field LlamaForCausalLM reads, in the spelling of transformers 4
    (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and 5 (``rope_parameters``, ``dtype``)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
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
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        **_FIXED,
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


# -- will these weights fit this model? ---------------------------------------------------------------
_FFN = "the FFN width (set model.intermediate_size, or model.dim, model.multiple_of, model.ffn_dim_multiplier)"


def hf_shape_problems(cfg: ModelConfig, hf: Dict, where: str) -> List[str]:
    """Why the weights described by Hugging Face config.json ``hf`` cannot be model.* ``cfg``;
    each problem names our key, its value, and the folder's field and value."""
    if hf.get("model_type") != "llama" and HF_ARCHITECTURE not in hf.get("architectures", []):
        return [f"{where} is not a Llama model (model_type={hf.get('model_type')!r}, architectures="
                f"{hf.get('architectures')}); model.init_from reads LlamaForCausalLM folders"]
    theirs = model_keys_from_hf(hf)
    pairs = [
        ("model.dim", cfg.dim, "hidden_size", theirs["dim"]),
        ("model.n_layers", cfg.n_layers, "num_hidden_layers", theirs["n_layers"]),
        ("model.n_heads", cfg.n_heads, "num_attention_heads", theirs["n_heads"]),
        ("model.n_kv_heads", cfg.kv_heads, "num_key_value_heads", theirs["n_kv_heads"]),
        ("model.vocab_size", cfg.vocab_size, "vocab_size", theirs["vocab_size"]),
        ("model.intermediate_size" if cfg.intermediate_size is not None else _FFN, cfg.ffn_hidden_dim,
         "intermediate_size", theirs["intermediate_size"]),
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
    for key, plain in _FIXED.items():
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
               "ffn_hidden_dim": lambda c: c.ffn_hidden_dim,  # multiple_of and ffn_dim_multiplier only size the FFN
               "rope_scaling": lambda c: _plain(c.rope_scaling)}
    problems = []
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings",
                "norm_eps", "rope_theta", "rope_scaling"):
        get = derived.get(key, lambda c, k=key: getattr(c, k))
        if get(cfg) != get(theirs):
            problems.append(f"{_FFN if key == 'ffn_hidden_dim' else 'model.' + key}={get(cfg)} but {where} has "
                            f"{key}={get(theirs)}")
    return problems
