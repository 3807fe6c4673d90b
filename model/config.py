"""Shape of a Llama-style decoder, shared by the model, the planner and the config schema."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from configs.bounds import divisors


@dataclass
class ModelConfig:
    """Hyper-parameters of the decoder; presets live in configs/model/*.yaml."""

    name: str = "debug"
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: same as n_heads (multi-head attention)
    vocab_size: int = 320
    multiple_of: int = 32  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    # The FFN width itself (config.json's intermediate_size); null: Llama's sizing from dim, multiple_of and
    # ffn_dim_multiplier (ffn_hidden_dim below). Set, it wins over the formula.
    intermediate_size: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Rotary scaling (model/rope.py): null is plain RoPE; Llama 3.1+ is config.json's rope_scaling,
    # {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.
    rope_scaling: Optional[Dict[str, Any]] = None
    max_seq_len: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Start from these weights instead of init_std's random ones (checkpoint/interop/init_from.py): a Hugging
    # Face Llama folder, a scripts/export.py safetensors file or a committed checkpoint. Not a shape.
    init_from: Optional[str] = None

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

    def validate(self) -> None:
        """Raise ValueError naming the numbers when the shape cannot work."""
        if self.dim <= 0 or self.n_layers <= 0 or self.n_heads <= 0:
            raise ValueError(
                f"model.dim ({self.dim}), model.n_layers ({self.n_layers}) and "
                f"model.n_heads ({self.n_heads}) must be positive"
            )
        if self.dim % self.n_heads:
            near = sorted(sorted(divisors(self.dim) or [], key=lambda h: abs(h - self.n_heads))[:3])
            raise ValueError(
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}"
                + (f"; head count that divides it: {near}" if near else "")
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.dim}/{self.n_heads} = {self.head_dim} "
                "must be even for rotary embeddings"
            )
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            valid = divisors(self.n_heads)
            raise ValueError(
                f"model.n_kv_heads={kv} does not divide model.n_heads={self.n_heads}"
                + (f"; valid n_kv_heads: {valid}" if valid else "")
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.vocab_size <= 0 or self.max_seq_len <= 0:
            raise ValueError(
                f"model.vocab_size ({self.vocab_size}) and model.max_seq_len "
                f"({self.max_seq_len}) must be positive"
            )
        if self.intermediate_size is not None and self.intermediate_size <= 0:
            raise ValueError(f"model.intermediate_size={self.intermediate_size} must be positive (null: the FFN "
                             "width from model.dim, model.multiple_of and model.ffn_dim_multiplier)")
        check_rope_scaling(self.rope_scaling)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: Optional[Dict[str, Any]]) -> None:
    """Raise ValueError unless ``scaling`` is null or Llama 3.1's rotary scaling with all four numbers."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"model.rope_scaling has rope_type={kind!r}; model/rope.py implements 'llama3' (Llama "
                         "3.1+), or set model.rope_scaling=null for plain rotary embeddings")
    missing = [k for k in LLAMA3_ROPE_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ValueError(f"model.rope_scaling (llama3) needs numbers for {missing}; it has {dict(scaling)}")
    if not scaling["factor"] >= 1 or not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"] \
            or scaling["original_max_position_embeddings"] <= 0:
        raise ValueError(f"model.rope_scaling={dict(scaling)}: llama3 scaling needs factor >= 1, "
                         "0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Llama's SwiGLU sizing: 2/3 of 4*dim, scaled, rounded up to a multiple.

    Llama 3 8B: dim 4096, x1.3, multiple_of 1024 -> 14336; 70B: dim 8192, x1.3,
    multiple_of 4096 -> 28672.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def model_config(cfg) -> ModelConfig:
    """The ModelConfig of a composed training config (its ``model`` section, interpolations resolved)."""
    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
