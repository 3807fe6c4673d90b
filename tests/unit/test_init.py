"""model/init.py: a parameter's values depend on (seed, name, position) only, so any block of
it, filled alone, equals the same block of the whole tensor, bit for bit; and a block costs
its own size plus the tile edges it cuts, not the whole tensor."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import ModelConfig
from model.init import TILE_COLS, TILE_ROWS, drawn_elements, fill_normal_, init_std
from model.llama import build_model


def full(shape, seed=5, name="layers.0.attention.wq.weight", std=0.02):
    out = torch.empty(shape)
    fill_normal_(out, shape, (0,) * len(shape), std, seed, name)
    return out


@pytest.mark.parametrize("shape", [(37, 3000), (300, 128), (5000,), (8, 2048)])
def test_any_block_equals_the_same_block_of_the_whole(shape):
    whole = full(shape)
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        lo = [int(torch.randint(0, n, (), generator=gen)) for n in shape]
        hi = [int(torch.randint(a + 1, n + 1, (), generator=gen)) for a, n in zip(lo, shape)]
        block = torch.empty([b - a for a, b in zip(lo, hi)])
        fill_normal_(block, shape, tuple(lo), 0.02, 5, "layers.0.attention.wq.weight")
        assert torch.equal(block, whole[tuple(slice(a, b) for a, b in zip(lo, hi))]), (lo, hi)


def test_values_depend_on_seed_and_name_and_have_the_requested_std():
    a = full((256, 1024))
    assert torch.equal(a, full((256, 1024)))
    assert not torch.equal(a, full((256, 1024), seed=6))
    assert not torch.equal(a, full((256, 1024), name="layers.0.attention.wk.weight"))
    assert a.mean().abs() < 1e-3 and a.std().item() == pytest.approx(0.02, rel=0.01)
    # tiles are independent streams: no two tiles repeat each other
    tiles = a.view(256 // TILE_ROWS, TILE_ROWS, 1, TILE_COLS).flatten(1)
    assert torch.unique(tiles[:, :8], dim=0).shape[0] == tiles.shape[0]


def test_scheme_per_parameter_and_single_process_build():
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=4)
    assert init_std(cfg, "layers.3.feed_forward.w2.weight") == cfg.init_std / math.sqrt(8)
    assert init_std(cfg, "layers.3.ffn_norm.weight") is None and init_std(cfg, "norm.weight") is None
    model = build_model(cfg, seed=11)
    wq = model.layers["2"].attention.wq.weight
    assert torch.equal(wq, full(tuple(wq.shape), seed=11, name="layers.2.attention.wq.weight", std=cfg.init_std))


def test_a_shard_draws_its_own_size_plus_the_tile_edges():
    # 70B wo under tp=8 (columns) then dp_shard=64 (rows): 128 x 1024 of 8192 x 8192, tile-aligned
    assert drawn_elements((8192, 8192), (128, 1024), (128 * 5, 1024 * 3)) == 128 * 1024
    # w2 (8192 x 28672) under tp=8: 3584 columns start mid-tile
    drawn = drawn_elements((8192, 28672), (128, 3584), (0, 3584))
    assert 128 * 3584 < drawn <= 128 * (3584 + 2 * TILE_COLS)
    # a two-row shard pays at most one tile of rows
    assert drawn_elements((1024, 8192), (2, 8192), (6, 0)) <= TILE_ROWS * 8192


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_equal_cpu_parameters():
    """The tiles are drawn on the host and copied band by band: the device does not change the values."""
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, vocab_size=3000)
    on_cpu, on_gpu = build_model(cfg, seed=3), build_model(cfg, "cuda", seed=3)
    for (name, a), b in zip(on_cpu.named_parameters(), on_gpu.parameters()):
        assert b.is_cuda and torch.equal(a, b.cpu()), name
