"""The decoder's shapes, counters and init match Llama's published numbers."""

import math

import pytest
import torch

from model.config import ModelConfig, ffn_hidden_dim
from model.counting import count_params, flops_per_token
from model.llama import apply_rope, build_model, rope_tables

LLAMA3_8B = dict(name="8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                 multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192)
LLAMA3_70B = dict(name="70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                  multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192)


def test_llama_ffn_sizing_rule():
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert ffn_hidden_dim(2048, 256, 1.5) == 8192
    assert ffn_hidden_dim(4096, 256, None) == 11008  # Llama 2 7B


@pytest.mark.parametrize("shape, expected", [(LLAMA3_8B, 8_030_261_248), (LLAMA3_70B, 70_553_706_496)])
def test_param_count_matches_meta_model_and_llama3(shape, expected):
    cfg = ModelConfig(**shape)
    assert count_params(cfg).total == expected
    model = build_model(cfg, materialize=False)  # meta device: no memory
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected


def test_flops_per_token_is_six_n_plus_attention():
    cfg = ModelConfig(**LLAMA3_8B)
    p = count_params(cfg)
    norms = cfg.dim * (2 * cfg.n_layers + 1)
    assert flops_per_token(cfg, 8192) == 6 * (p.total - p.embedding - norms) + 12 * 32 * 4096 * 8192


def test_tied_embeddings_share_storage_after_materialising():
    cfg = ModelConfig(tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


def test_init_scheme_and_seed_determinism():
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=4, init_std=0.02)
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    residual = a.layers["0"].attention.wo.weight.std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1)
    assert a.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(a.norm.weight == 1)


def test_forward_is_causal_and_gqa_runs():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab_size
    # Positions before the change see the same prefix, so their logits are unchanged.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_rope_preserves_norm_and_encodes_relative_position():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i, j):
        qi = apply_rope(q, cos[i:i + 1], sin[i:i + 1])
        kj = apply_rope(k, cos[j:j + 1], sin[j:j + 1])
        return (qi * kj).sum().item()

    rotated = apply_rope(q, cos[5:6], sin[5:6])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-5)
    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-4)


def test_dropout_is_random_only_in_training():
    model = build_model(ModelConfig(dropout=0.2), seed=0)
    tokens = torch.randint(0, 320, (2, 16))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=100, n_heads=3), "n_heads=3 does not divide model.dim=100"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads=3 does not divide model.n_heads=4"),
])
def test_bad_shapes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs).validate()


def _pairwise_rope(x, cos, sin):
    """The rotation as autograd forms it from the pairwise formula (the reference apply_rope keeps the bits of)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_keeps_the_pairwise_formulas_bits_forward_and_backward(dtype):
    torch.manual_seed(0)
    cos, sin = rope_tables(16, 64, 500000.0)
    base, grad = torch.randn(2, 64, 4 * 16).to(dtype), torch.randn(2, 4, 64, 16).to(dtype)
    from model.llama import _Rope
    results = []
    for rope in (_pairwise_rope, apply_rope, _Rope.apply):  # on CPU: complex numbers; elsewhere: _Rope
        x = base.clone().requires_grad_()
        out = rope(x.view(2, 64, 4, 16), cos, sin).transpose(1, 2)  # the gradient arrives strided, as from SDPA
        (out * grad).sum().backward()
        results.append((out.detach(), x.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dim", [128, 256, 1000, 4096])
def test_rms_norms_fused_path_keeps_the_formulas_bits_forward_and_backward(dim):
    from model.llama import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    assert norm._fused(torch.zeros(1, dim))
    base, grad = torch.randn(3, 33, dim) * 3, torch.randn(3, 33, dim)
    results = []
    for fused in (False, True):
        norm._fused = (lambda x: True) if fused else (lambda x: False)
        x = base.clone().requires_grad_()
        norm.weight.grad = None
        out = norm(x)
        (out * grad).sum().backward()
        results.append((out.detach(), x.grad, norm.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
