"""Initial values that are a pure function of (seed, parameter name, element position), so
any layout (one process, FSDP2, TP, HSDP, any mix) gets bitwise the same global parameters,
and a rank computes only its own shard.

Each parameter is viewed as a 2-D matrix (rows = dim 0) and cut into fixed tiles of
``TILE_ROWS x TILE_COLS`` (clipped at the edges). Tile t of parameter p draws from Philox
(a counter-based generator, numpy's ``np.random.Philox``) with key = hash(seed, p) and
counter = t in the top word: a tile's values depend on nothing else, and no tile's stream
can run into another's. A rank draws only the tiles that overlap its shard (a box of rows
x columns: TP splits rows or columns, FSDP2 then splits rows again), in float32 on the
host, scaled by the parameter's std in float32, and copies one band of tiles at a time to
the shard's device, on up to torch.get_num_threads() threads. Memory: the shard plus one
band per thread; time: the shard plus the tile edges it cuts (``drawn_elements``). The
values do not depend on the device either (CPU and CUDA runs start from the same numbers).

The scheme (``init_std``): embeddings and every linear N(0, init_std); the two projections
writing into the residual stream (attention.wo, feed_forward.w2) N(0, init_std / sqrt(2
n_layers)) (GPT-2); norm weights 1.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Tuple

import numpy as np
import torch
from torch import nn

from model.config import ModelConfig

TILE_ROWS, TILE_COLS = 4, 1024
MAX_THREADS = 16  # bands drawn in parallel, at most torch.get_num_threads()
RESIDUAL_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


def init_std(cfg: ModelConfig, name: str) -> Optional[float]:
    """Standard deviation of a weight's normal init; None for a norm weight (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(RESIDUAL_PROJECTIONS):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def philox_key(seed: int, name: str) -> int:
    """128-bit Philox key of one parameter."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=16).digest(), "little")


def as_matrix(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """(rows, cols) the tiles are laid over; a vector is one row. The model has no parameter of
    more than two dimensions."""
    if len(shape) > 2:
        raise NotImplementedError(f"init tiles cover vectors and matrices, not a {len(shape)}-D parameter {shape}")
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def shard_box(shape: Tuple[int, ...], local_shape: Tuple[int, ...], offset: Tuple[int, ...]):
    """The shard as (row range, column range) of the matrix view."""
    as_matrix(shape)
    if len(shape) == 1:
        return range(0, 1), range(offset[0], offset[0] + local_shape[0])
    return range(offset[0], offset[0] + local_shape[0]), range(offset[1], offset[1] + local_shape[1])


def _tiles(span: range, size: int) -> range:
    """Indices of the tiles of ``size`` that overlap ``span``."""
    return range(span.start // size, -(-span.stop // size)) if len(span) else range(0)


def _tile_span(index: int, size: int, n: int) -> range:
    """The positions tile ``index`` covers along an axis of length ``n`` (clipped at the end)."""
    return range(index * size, min(n, (index + 1) * size))


def drawn_elements(shape: Tuple[int, ...], local_shape: Tuple[int, ...], offset: Tuple[int, ...]) -> int:
    """How many numbers a rank draws for its shard (the tiles it overlaps)."""
    rows, cols = as_matrix(shape)
    box_rows, box_cols = shard_box(shape, local_shape, offset)
    tr = sum(len(_tile_span(i, TILE_ROWS, rows)) for i in _tiles(box_rows, TILE_ROWS))
    tc = sum(len(_tile_span(j, TILE_COLS, cols)) for j in _tiles(box_cols, TILE_COLS))
    return tr * tc


def fill_normal_(local: torch.Tensor, shape: Tuple[int, ...], offset: Tuple[int, ...], std: float,
                 seed: int, name: str) -> None:
    """Write N(0, std) into ``local``, the block of the global ``shape`` starting at ``offset``."""
    rows, cols = as_matrix(shape)
    box_rows, box_cols = shard_box(shape, tuple(local.shape), offset)
    if local.numel() == 0:
        return
    out = local.view(len(box_rows), len(box_cols))
    key = philox_key(seed, name)
    n_tile_cols = -(-cols // TILE_COLS)
    scale = np.float32(std)

    def draw_band(i: int) -> Tuple[range, np.ndarray]:
        """Tile row ``i``'s part of the shard, drawn with numpy only (no torch op off the main thread)."""
        tile_rows = _tile_span(i, TILE_ROWS, rows)
        band_rows = range(max(tile_rows.start, box_rows.start), min(tile_rows.stop, box_rows.stop))
        band = np.empty((len(band_rows), len(box_cols)), dtype=np.float32)
        for j in _tiles(box_cols, TILE_COLS):
            tile_cols = _tile_span(j, TILE_COLS, cols)
            gen = np.random.Generator(np.random.Philox(key=key, counter=(i * n_tile_cols + j) << 192))
            tile = gen.standard_normal((len(tile_rows), len(tile_cols)), dtype=np.float32)
            tile *= scale
            c0, c1 = max(tile_cols.start, box_cols.start), min(tile_cols.stop, box_cols.stop)
            band[:, c0 - box_cols.start:c1 - box_cols.start] = tile[band_rows.start - tile_rows.start:
                                                                    band_rows.stop - tile_rows.start,
                                                                    c0 - tile_cols.start:c1 - tile_cols.start]
        return band_rows, band

    def copy_band(band_rows: range, band: np.ndarray) -> None:
        out[band_rows.start - box_rows.start:band_rows.stop - box_rows.start].copy_(torch.from_numpy(band))

    bands = _tiles(box_rows, TILE_ROWS)
    threads = min(torch.get_num_threads(), MAX_THREADS, len(bands))
    if threads <= 1:
        for i in bands:
            copy_band(*draw_band(i))
        return
    # Bands are independent (their own tiles, their own rows of out) and numpy draws without the
    # GIL: up to ``threads`` bands are drawn at once, and copied into the shard on this thread
    # (torch ops from short-lived Python threads have made workers abort at exit, "terminate
    # called without an active exception").
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(bands), threads):
            for band_rows, band in pool.map(draw_band, bands[start:start + threads]):
                copy_band(band_rows, band)


def local_block(param: torch.Tensor):
    """(local tensor, global shape, global offset) of a parameter: a DTensor's shard or a whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, tuple(param.shape), (0,) * param.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise RuntimeError(f"shard of shape {tuple(local.shape)} where the placements say {tuple(local_shape)}")
    return local, tuple(param.shape), tuple(offset)


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter's local part (the whole tensor, or this rank's shard)."""
    for name, param in model.named_parameters():
        local, shape, offset = local_block(param)
        std = init_std(cfg, name)
        if std is None:
            local.fill_(1.0)
        else:
            fill_normal_(local, shape, offset, std, seed, name)
