"""Llama 3 70B under its real parallel plan, on the meta device and a fake process group of 512
ranks (torch's FakeStore, as planner/plan.py uses): FSDP2 over dp_shard=64 x TP 8, the
experiment's own parallel config (selective checkpointing, loss parallel, bf16 all-gathers).

Ranks 0 and 511 (the last, with the short vocabulary shard) are parallelised for real and
their local shards checked against hand arithmetic; on rank 0, the placements give every
rank's shard shape, again checked against hand arithmetic, and the shards of every
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
from omegaconf import OmegaConf
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from model.init import drawn_elements
from model.llama import build_model
from parallel.dims import resolve_parallel_dims
from parallel.parallelize import parallelize_model
from support.launch import ROOT
from trainer.config import register

WORLD, DP, TP = 512, 64, 8
D, KV, F, V = 8192, 1024, 28672, 128256


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def expected_shape(rank: int, name: str) -> tuple:
    """Hand arithmetic: TP splits (Colwise: rows, Rowwise: columns), then FSDP2 splits dim 0 by 64.
    The vocabulary: 128256 / 8 = 16032 rows per tp rank, chunks of ceil(16032 / 64) = 251, so
    dp ranks 0..62 hold 251 rows and dp rank 63 the remaining 16032 - 63 * 251 = 219."""
    vocab_rows = 251 if rank // TP < 63 else 16032 - 63 * 251
    shapes = {
        "attention.wq.weight": (D // TP // DP, D), "attention.wk.weight": (KV // TP // DP, D),
        "attention.wv.weight": (KV // TP // DP, D), "attention.wo.weight": (D // DP, D // TP),
        "feed_forward.w1.weight": (F // TP // DP, D), "feed_forward.w3.weight": (F // TP // DP, D),
        "feed_forward.w2.weight": (D // DP, F // TP), "norm.weight": (D // DP,),
        "tok_embeddings.weight": (vocab_rows, D), "output.weight": (vocab_rows, D),
    }
    return shapes[name.split(".", 2)[-1] if name.startswith("layers.") else name] if not name.endswith(
        "_norm.weight") else (D // DP,)


@pytest.fixture(scope="module")
def cfg():
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=70b", f"parallel.dp_shard={DP}"])


def parallelized(cfg, rank: int):
    dims = resolve_parallel_dims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, WORLD)
    model = build_model(OmegaConf.to_object(cfg.model), materialize=False)
    parallelize_model(model, dims, cfg.parallel, torch.device("cpu"), seq_len=cfg.training.seq_len)
    return model


@pytest.mark.parametrize("rank", [0, 511])
def test_each_rank_holds_the_shards_hand_arithmetic_gives(cfg, rank):
    before = _rss()
    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        model = parallelized(cfg, rank)
        params = dict(model.named_parameters())
        assert all(p.is_meta for p in params.values())
        assert len(params) == 80 * 9 + 3
        for name, p in params.items():
            assert tuple(p.to_local().shape) == expected_shape(rank, name), name
        assert params["layers.0.attention.wq.weight"].device_mesh.shape == (DP, TP)
        assert _rss() - before < 512 * 2**20  # 70.6 B parameters, nothing allocated
        if rank == 0:
            _check_tiling_and_init_cost(params)
    finally:
        dist.destroy_process_group()


def nested_chunks(shape, mesh_shape, coord, placements):
    """(local shape, offset) when TP shards first and FSDP2 then chunks the TP shard (torch.chunk
    sizes: ceil(n / k), the remainder on the last ranks): placements applied innermost mesh dim first."""
    start, size = [0] * len(shape), list(shape)
    for mesh_dim in reversed(range(len(mesh_shape))):
        placement = placements[mesh_dim]
        if placement.is_shard() or isinstance(placement, _StridedShard):
            d, k, i = placement.dim, mesh_shape[mesh_dim], coord[mesh_dim]
            chunk = -(-size[d] // k)
            start[d], size[d] = start[d] + min(i * chunk, size[d]), max(0, min(chunk, size[d] - i * chunk))
    return tuple(size), tuple(start)


def _check_tiling_and_init_cost(params) -> None:
    """Over all 512 coordinates: each rank's shard (TP then FSDP2 chunks; torch's own placement
    arithmetic agrees on a sample of coordinates) has the hand-arithmetic shape; the shards are a
    grid of boxes covering each tensor exactly; a rank draws at most 1.5x the elements it holds."""
    own, drawn = [0] * WORLD, [0] * WORLD
    for name, p in params.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue  # layers 1..79 are layer 0 again
        weight = 80 if name.startswith("layers.0.") else 1
        ranks, mesh_shape = p.device_mesh.mesh, tuple(p.device_mesh.mesh.shape)
        boxes = set()
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            shape, offset = nested_chunks(tuple(p.shape), mesh_shape, coord, p.placements)
            if coord[0] in (0, 31, 63) and coord[1] in (0, 7):
                torch_says = _compute_local_shape_and_global_offset(p.shape, mesh_shape, list(coord), p.placements)
                assert (shape, offset) == tuple(map(tuple, torch_says)), (name, coord)
            rank = int(ranks[coord])
            assert shape == expected_shape(rank, name), (name, rank)  # every rank's shard, by hand
            boxes.add(tuple((o, o + n) for o, n in zip(offset, shape)))
            own[rank] += weight * torch.Size(shape).numel()
            drawn[rank] += weight * drawn_elements(tuple(p.shape), shape, offset)
        spans = [sorted({box[d] for box in boxes}) for d in range(p.dim())]
        for d, dim_spans in enumerate(spans):  # the ranges along each dim partition it
            assert dim_spans[0][0] == 0 and dim_spans[-1][1] == p.shape[d], (name, d)
            assert all(a[1] == b[0] for a, b in zip(dim_spans, dim_spans[1:])), (name, d)
        assert boxes == set(itertools.product(*spans)), name  # and every combination is one shard
    assert own[0] == 137_826_432 and min(own) > 0  # the planner's per-rank count (tests/integration/test_plan.py)
    ratio = max(d / o for d, o in zip(drawn, own))
    print(f"70B init: a rank draws at most {ratio:.3f}x the elements it holds")
    assert ratio <= 1.5
