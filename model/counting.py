"""Parameter and FLOP arithmetic from the config alone, so it works for 70B on a laptop."""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token embedding (and the output layer when it is tied)
    output: int  # 0 when tied to the embedding
    per_layer: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(cfg: ModelConfig) -> ParamCount:
    """Exact parameter count of ``model.llama.Transformer`` for this config."""
    d, hd, kv = cfg.dim, cfg.head_dim, cfg.kv_heads
    attention = d * cfg.n_heads * hd + 2 * d * kv * hd + cfg.n_heads * hd * d
    mlp = 3 * d * cfg.ffn_hidden_dim
    per_layer = attention + mlp + 2 * d  # two RMSNorm weights
    embedding = cfg.vocab_size * d
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + cfg.n_layers * per_layer + d + output  # + final norm
    return ParamCount(total=total, embedding=embedding, output=output, per_layer=per_layer)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * (matmul params) + 12 * n_layers * dim * seq_len.

    The first term is forward + backward of every weight matmul (the output layer
    included, the embedding lookup excluded); the second is the attention score and
    value matmuls (PaLM appendix B, causal masking not discounted).
    """
    p = count_params(cfg)
    matmul_params = p.total - p.embedding + (p.embedding if cfg.tie_embeddings else 0)
    norms = cfg.dim * (2 * cfg.n_layers + 1)
    return 6 * (matmul_params - norms) + 12 * cfg.n_layers * cfg.dim * seq_len
