"""Llama 3 70B under its real parallel plan, on the meta device and a fake process group of 512
ranks (torch's FakeStore, as trainer/plan.py uses): FSDP2 over dp_shard=64 x TP 8, the
experiment's own parallel config (selective checkpointing, loss parallel, bf16 all-gathers).

Each rank's local shard shapes are checked against hand arithmetic; the shards of every
parameter over all 512 mesh coordinates tile the global tensor exactly (what sharded init
relies on: model/init.py fills each rank's box); what a rank draws to initialise its shards
is its own size plus tile edges; and nothing is allocated.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from configs.schema import register
from configs.validate import model_config
from helpers.launch import ROOT
from model.init import drawn_elements
from model.llama import build_model
from parallel.dims import resolve_parallel_dims
from parallel.parallelize import parallelize_model

WORLD, DP, TP = 512, 64, 8
D, KV, F, V = 8192, 1024, 28672, 128256


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def expected_local_shapes(rank: int) -> dict:
    """Hand arithmetic: TP splits (Colwise: rows, Rowwise: columns), then FSDP2 splits dim 0 by 64.
    The vocabulary: 128256 / 8 = 16032 rows per tp rank, chunks of ceil(16032 / 64) = 251, so
    dp ranks 0..62 hold 251 rows and dp rank 63 the remaining 16032 - 63 * 251 = 219."""
    dp = rank // TP
    vocab_rows = 251 if dp < 63 else 16032 - 63 * 251
    block = {
        "attention.wq.weight": (D // TP // DP, D), "attention.wk.weight": (KV // TP // DP, D),
        "attention.wv.weight": (KV // TP // DP, D), "attention.wo.weight": (D // DP, D // TP),
        "feed_forward.w1.weight": (F // TP // DP, D), "feed_forward.w3.weight": (F // TP // DP, D),
        "feed_forward.w2.weight": (D // DP, F // TP),
        "attention_norm.weight": (D // DP,), "ffn_norm.weight": (D // DP,),
    }
    shapes = {f"layers.{i}.{k}": v for i in range(80) for k, v in block.items()}
    shapes.update({"tok_embeddings.weight": (vocab_rows, D), "output.weight": (vocab_rows, D),
                   "norm.weight": (D // DP,)})
    return shapes


@pytest.fixture(scope="module")
def cfg():
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=70b", f"parallel.dp_shard={DP}"])


def parallelized(cfg, rank: int):
    dims = resolve_parallel_dims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, WORLD)
    model = build_model(model_config(cfg), materialize=False)
    parallelize_model(model, dims, cfg.parallel, torch.device("cpu"), seq_len=cfg.training.seq_len)
    return model


@pytest.mark.parametrize("rank", [0, 9, 504, 511])
def test_each_rank_holds_the_shards_hand_arithmetic_gives(cfg, rank):
    before = _rss()
    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        model = parallelized(cfg, rank)
        params = dict(model.named_parameters())
        assert all(p.is_meta for p in params.values())
        got = {name: tuple(p.to_local().shape) for name, p in params.items()}
        assert got == expected_local_shapes(rank)
        assert params["layers.0.attention.wq.weight"].device_mesh.shape == (DP, TP)
        assert _rss() - before < 512 * 2**20  # 70.6 B parameters, nothing allocated
        if rank == 0:
            _check_tiling_and_init_cost(params)
    finally:
        dist.destroy_process_group()


def _check_tiling_and_init_cost(params) -> None:
    """Over all 512 coordinates: shards are a grid of boxes covering each tensor exactly; the
    elements a rank draws at init stay within 1.5x of the elements it holds."""
    own, drawn = [0] * WORLD, [0] * WORLD
    for name, p in params.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue  # layers 1..79 are layer 0 again
        weight = 80 if name.startswith("layers.0.") else 1
        ranks = p.device_mesh.mesh
        boxes = set()
        for coord in itertools.product(*(range(n) for n in ranks.shape)):
            shape, offset = _compute_local_shape_and_global_offset(p.shape, tuple(ranks.shape), list(coord),
                                                                   p.placements)
            boxes.add(tuple((o, o + n) for o, n in zip(offset, shape)))
            rank = int(ranks[coord])
            own[rank] += weight * torch.Size(shape).numel()
            drawn[rank] += weight * drawn_elements(tuple(p.shape), shape, offset)
        spans = [sorted({box[d] for box in boxes}) for d in range(p.dim())]
        for d, dim_spans in enumerate(spans):  # the ranges along each dim partition it
            assert dim_spans[0][0] == 0 and dim_spans[-1][1] == p.shape[d], (name, d)
            assert all(a[1] == b[0] for a, b in zip(dim_spans, dim_spans[1:])), (name, d)
        assert boxes == set(itertools.product(*spans)), name  # and every combination is one shard
    assert own[0] == 137_826_432 and min(own) > 0  # the planner's per-rank count (tests/test_plan.py)
    ratio = max(d / o for d, o in zip(drawn, own))
    print(f"70B init: a rank draws at most {ratio:.3f}x the elements it holds")
    assert ratio <= 1.5
