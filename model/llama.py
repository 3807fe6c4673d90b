"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Module names follow Meta's reference code (tok_embeddings, layers.N.attention.wq, ...,
feed_forward.w1/w2/w3, norm, output) so that the tensor-parallel plan and exported
checkpoints use the names people already know.

Init scheme (``Transformer.init_weights``, values from model/init.py): every linear and the
embedding draw from N(0, init_std); the two projections that write into the residual stream
(attention.wo and feed_forward.w2) use init_std / sqrt(2 * n_layers) so the residual variance
does not grow with depth (GPT-2); norms start at 1. The values depend on (seed, parameter
name, position) only, so a sharded model computes just its shard and still equals one
process. The output layer is tied to the embedding when ``tie_embeddings`` is set: one
parameter, ``tok_embeddings.weight``, used at both ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.init import init_parameters
from model.kv_cache import KVCache, LayerCache
from model.rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def _fused(self, x: torch.Tensor) -> bool:
        """torch's fused kernel where it gives this formula's bits, forward and backward (tests/unit/test_model.py:
        plain fp32 tensors on CPU, no autocast); it saves the formula's five elementwise passes (0.45 of 3.2 ms
        of CPU per call, fwd+bwd, at the 6.2M shape: docs/measurements.md, 2026-12-05)."""
        w = self.weight
        return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
                and type(x) is torch.Tensor and not hasattr(w, "placements")  # not DTensors
                and not torch.is_autocast_enabled("cpu"))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each consecutive pair (a, b) of the last dim of fp32 ``x`` to (a cos - b sin, a sin + b cos), written into
    the halves of one new tensor (no stack); cos and sin broadcast to x's leading dims."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    halves = out.unflatten(-1, (-1, 2))
    out_even, out_odd = halves[..., 0], halves[..., 1]
    torch.mul(even, cos, out=out_even)
    out_even.sub_(odd * sin)
    torch.mul(even, sin, out=out_odd)
    out_odd.add_(odd * cos)
    return out


class _Rope(torch.autograd.Function):
    """The rotation with its backward written out, the inverse rotation of the gradient, (g0 cos + g1 sin,
    g1 cos - g0 sin) as ``_rotate`` by -sin: the same products and sums that autograd forms from the pairwise
    formula (x - (-y) = x + y, -(x y) = x (-y) and x + y = y + x in floating point), so the same bits
    (tests/unit/test_model.py), without autograd's stack, select and unflatten backwards (docs/measurements.md,
    2026-12-05: the step at 2 processes, 6.2M)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x.float(), cos, sin).type_as(x)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad.float(), cos, -sin).to(ctx.dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by position. On CPU as complex numbers: torch's
    complex product there forms (a cos - b sin, a sin + b cos) and its gradient from the same products and sums,
    so the same bits (tests/unit/test_model.py), at a quarter of the CPU (docs/measurements.md, 2026-12-05).
    fp32 only: torch has no bf16 complex numbers (bf16 goes the other way)."""
    if x.device.type == "cpu" and type(x) is torch.Tensor and x.dtype == cos.dtype == torch.float32:
        rotation = torch.complex(cos, sin)[None, :, None, :]
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)
    return _Rope.apply(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = None
        if cache is not None:  # decoding (model/kv_cache.py): attend to the cached positions as well
            k, v, mask = cache.extend(k, v)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=cache is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.ffn_hidden_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        decoding = {} if cache is None else {"cache": cache}  # by keyword: the TP plan sees (x, cos, sin)
        x = x + self.attention(self.attention_norm(x), cos, sin, **decoding)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        # A ModuleDict keyed by layer index keeps FQNs stable if layers are ever pruned
        # or split across pipeline stages.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling)
        # Derived from the config, so not part of the checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """With tie_embeddings, make the output layer use the embedding's parameter. Called again
        wherever a parameter is replaced per module (tensor parallel, ``to_empty``)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Fill parameters (the whole tensors, or this rank's shards) and buffers; called after
        ``to_empty`` on a meta-built model. ``seed=None`` takes one from torch's global RNG."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=buffer_device,
                               scaling=cfg.rope_scaling)
        self.rope_cos = cos
        self.rope_sin = sin
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        init_parameters(self, cfg, seed)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab). With a ``cache`` (inference,
        model/kv_cache.py) the tokens continue the cached positions and are added to the cache."""
        seqlen = tokens.shape[1]
        start = 0 if cache is None else cache.pos
        if start + seqlen > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {start + seqlen} exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        if cache is not None:
            cache.check_room(seqlen)
        h = self.embed_dropout(self.tok_embeddings(tokens))
        cos, sin = self.rope_cos[start:start + seqlen], self.rope_sin[start:start + seqlen]
        for i, block in enumerate(self.layers.values()):
            h = block(h, cos, sin) if cache is None else block(h, cos, sin, cache=cache.layer(i))
        if cache is not None:
            cache.advance(seqlen)
        return self.output(self.norm(h))


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int | None = None,
                materialize: bool = True) -> Transformer:
    """Build on the meta device (no memory), then materialise on ``device`` and init.

    Parallel wrappers (FSDP2, TP) are applied between building and materialising; call
    with materialize=False for that and finish with ``materialize_model``.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if materialize:
        materialize_model(model, device, seed)
    return model


def materialize_model(model: Transformer, device: torch.device | str, seed: int | None = None,
                     param_device: torch.device | str | None = None) -> None:
    """Allocate real storage for a meta-built (possibly sharded) model and initialise it: each
    rank allocates and fills only its own shards. ``param_device`` (default ``device``) is
    where parameters live (host memory under CPU offload); buffers are on ``device``."""
    device = torch.device(device)
    model.to_empty(device=param_device or device)
    model.tie_weights()  # to_empty makes a new tensor per module: tie again
    model.init_weights(buffer_device=device, seed=seed)
