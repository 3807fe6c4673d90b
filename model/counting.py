"""The decoder's arithmetic from the config alone (torch-free, so it works for 70B on a laptop):
parameters, training FLOPs and the tensor-parallel collectives of its plan (its activation memory is
model/activation_memory.py, which only the planner imports). Beside the model because each number
follows from model/llama.py and model/parallelize.py: a change there changes the counts here, and tests
hold them to the model (tests/unit/test_model.py, tests/integration/test_parallel.py). A run's banner
and MFU (metrics/throughput.py) and the planner (planner/) use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token embedding (and the output layer when it is tied)
    output: int  # 0 when tied to the embedding
    per_layer: int
    matmul: int  # weights every token is multiplied by: the blocks' and the output layer's (tied: the embedding)
    layer_matmul: int  # one block's matmul weights (its norms aside)

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
    return ParamCount(total=total, embedding=embedding, output=output, per_layer=per_layer,
                      matmul=cfg.n_layers * (attention + mlp) + cfg.vocab_size * d, layer_matmul=attention + mlp)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * (matmul params) + 12 * n_layers * dim * seq_len.

    The first term is forward + backward of every weight matmul (the output layer
    included, the embedding lookup excluded); the second is the attention score and
    value matmuls (PaLM appendix B, causal masking not discounted).
    """
    return 6 * count_params(cfg).matmul + 12 * cfg.n_layers * cfg.dim * seq_len


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, mode: str) -> int:
    """Full checkpointing runs every block's forward twice: 2 FLOPs per block matmul weight and
    the attention forward (4 x dim x seq_len per layer); selective recomputes no matmul."""
    if mode != "full":
        return 0
    return cfg.n_layers * (2 * count_params(cfg).layer_matmul + 4 * cfg.dim * seq_len)


# The collectives model/parallelize.py's tensor-parallel plan issues per step, each over one b x s x dim
# activation: per block an all-gather before attention and before the FFN and a reduce-scatter after
# each, 4 in forward, the same 4 in backward, and in backward again what checkpointing recomputes
# (selective: the 2 all-gathers, its save list keeps the reduce-scatters; full: those and the
# attention's reduce-scatter, the recompute stops before the last); 4 around the embedding and the
# output layer. Counted on a tp=2 run by tests/support/workers/sac_collectives.py
# (tests/integration/test_parallel.py). A forward alone issues half of the no-checkpointing count.
TP_COLLECTIVES_PER_BLOCK = {"none": 8, "selective": 10, "full": 11}  # forward + backward (+ recompute)
TP_COLLECTIVES_OUTSIDE_BLOCKS = 4  # embedding output and output-layer input, forward and backward
