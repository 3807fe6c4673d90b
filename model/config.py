"""The model section (``model.*``): the decoder's shape, each key declared once with its bound and meaning.

Presets are configs/model/*.yaml. A preset sets every shape key; configs/model/hf.yaml leaves them unset
(``???``) for model.init_from's weights to fill (checkpoint/interop/model_shape.py), which is why the run's
schema holds them unset (``unset_shape``): a default there would win over ``???`` when the preset merges.
Torch-free, so the config checks run before torch is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List, Optional

from configs.keys import FRACTION, SIZE, Bound, divisors, in_bounds, key, problems

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_BOUNDS = {  # model.rope_scaling's numbers: a finite context extension of a finite context
    "factor": Bound(1, 1e6), "low_freq_factor": Bound(0, 1e6, open_low=True),
    "high_freq_factor": Bound(0, 1e6, open_low=True), "original_max_position_embeddings": Bound(1, 2**24)}
UNSET = "???"  # OmegaConf's MISSING: a key the composed config leaves unset


@dataclass
class ModelConfig:
    name: str = key("debug", "the preset's name (configs/model/NAME.yaml)")
    dim: int = key(64, "the model width", SIZE, shape=True)
    n_layers: int = key(2, "transformer blocks", Bound(1, 2**20), shape=True)
    n_heads: int = key(4, "attention heads", SIZE, shape=True)
    n_kv_heads: Optional[int] = key(None, "key/value heads (grouped-query attention); null: n_heads", SIZE,
                                    shape=True)
    vocab_size: int = key(320, "rows of the embedding and the output layer", SIZE, shape=True)
    multiple_of: int = key(32, "the FFN width is rounded up to a multiple of this",
                           Bound(1, 2**31 - 1, why="the FFN width is rounded up to it"))
    ffn_dim_multiplier: Optional[float] = key(None, "scales Llama's FFN width (8B and 70B: 1.3)",
                                              Bound(0, 100, open_low=True))
    intermediate_size: Optional[int] = key(None, "the FFN width itself (config.json's); null: from dim, "
                                           "multiple_of and ffn_dim_multiplier", SIZE, shape=True)
    norm_eps: float = key(1e-5, "RMSNorm's epsilon", Bound(0, 1, open_low=True), shape=True)
    rope_theta: float = key(10000.0, "the rotary base", Bound(0, 1e30, open_low=True), shape=True)
    rope_scaling: Optional[Dict[str, Any]] = key(
        None, "null: plain RoPE; Llama 3.1+: {rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings} (model/rope.py)", bounds=ROPE_BOUNDS, shape=True)
    max_seq_len: int = key(256, "the longest sequence the rotary tables cover", Bound(1, 2**24), shape=True)
    dropout: float = key(0.0, "dropout after the embedding, attention and FFN (training only)", FRACTION)
    tie_embeddings: bool = key(False, "the output layer shares the embedding's weight", shape=True)
    init_std: float = key(0.02, "standard deviation of the initial weights", Bound(0, 1, open_low=True))
    init_from: Optional[str] = key(  # unit: interop
        None, "start from these weights instead of random ones (checkpoint/interop/init_from.py): a Hugging Face "
        "Llama folder, a scripts/export.py safetensors file or a committed checkpoint; not a shape")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def check(self) -> List[str]:
        """What the shape's keys cannot be together (each key's own bound is its declaration's; while one is out
        of it, that is the message: no search over the divisors of an absurd value)."""
        if not in_bounds(self):
            return []
        out = []
        if self.dim % self.n_heads:
            near = sorted(sorted(divisors(self.dim) or [], key=lambda h: abs(h - self.n_heads))[:3])
            out.append(f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}"
                       + (f"; head count that divides it: {near}" if near else ""))
        elif self.head_dim % 2:
            out.append(f"head_dim = dim / n_heads = {self.dim}/{self.n_heads} = {self.head_dim} must be even for "
                       "rotary embeddings")
        if self.n_heads % self.kv_heads:
            valid = divisors(self.n_heads)
            out.append(f"model.n_kv_heads={self.kv_heads} does not divide model.n_heads={self.n_heads}"
                       + (f"; valid n_kv_heads: {valid}" if valid else ""))
        return out + rope_scaling_problems(self.rope_scaling)

    def validate(self) -> None:
        """Raise ValueError naming the numbers when the shape cannot work (a model built outside a run)."""
        found = problems(self, "model")  # the keys' bounds, then check()
        if found:
            raise ValueError("; ".join(found))


def rope_scaling_problems(scaling: Optional[Dict[str, Any]]) -> List[str]:
    """Nothing when ``scaling`` is null or Llama 3.1's rotary scaling with all four numbers."""
    if scaling is None:
        return []
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        return [f"model.rope_scaling has rope_type={kind!r}; model/rope.py implements 'llama3' (Llama 3.1+), or "
                "set model.rope_scaling=null for plain rotary embeddings"]
    missing = [k for k in LLAMA3_ROPE_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        return [f"model.rope_scaling (llama3) needs numbers for {missing}; it has {dict(scaling)}"]
    if not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        return [f"model.rope_scaling={dict(scaling)}: llama3 scaling needs low_freq_factor < high_freq_factor"]
    return []


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Llama's SwiGLU sizing: 2/3 of 4*dim, scaled, rounded up to a multiple.

    Llama 3 8B: dim 4096, x1.3, multiple_of 1024 -> 14336; 70B: dim 8192, x1.3,
    multiple_of 4096 -> 28672.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


SHAPE_KEYS = tuple(f.name for f in fields(ModelConfig) if f.metadata.get("shape"))


def unset_shape() -> ModelConfig:
    """The model section as the run's schema holds it: every shape key unset, for a preset to set (or
    model=hf's weights to fill)."""
    return replace(ModelConfig(), **{k: UNSET for k in SHAPE_KEYS})
