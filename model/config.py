"""Shape of a Llama-style decoder, shared by the model, the planner and the config schema."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf


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
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
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
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def validate(self) -> None:
        """Raise ValueError naming the numbers when the shape cannot work."""
        if self.dim <= 0 or self.n_layers <= 0 or self.n_heads <= 0:
            raise ValueError(
                f"model.dim ({self.dim}), model.n_layers ({self.n_layers}) and "
                f"model.n_heads ({self.n_heads}) must be positive"
            )
        if self.dim % self.n_heads:
            divisors = [h for h in range(1, self.dim + 1) if self.dim % h == 0]
            near = sorted(divisors, key=lambda h: abs(h - self.n_heads))[:3]
            raise ValueError(
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}; "
                f"head count that divides it: {sorted(near)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.dim}/{self.n_heads} = {self.head_dim} "
                "must be even for rotary embeddings"
            )
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            valid = [k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
            raise ValueError(
                f"model.n_kv_heads={kv} does not divide model.n_heads={self.n_heads}; "
                f"valid n_kv_heads: {valid}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.vocab_size <= 0 or self.max_seq_len <= 0:
            raise ValueError(
                f"model.vocab_size ({self.vocab_size}) and model.max_seq_len "
                f"({self.max_seq_len}) must be positive"
            )


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
