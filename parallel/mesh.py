"""The DeviceMesh for a ParallelDims: named dimensions, plus the flattened data-parallel one."""

from __future__ import annotations

from typing import Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.dims import ParallelDims


def build_mesh(dims: ParallelDims, device: torch.device) -> Tuple[DeviceMesh, DeviceMesh]:
    """The (dp_replicate, dp_shard, tp) mesh and its flattened data-parallel mesh.

    Sub-meshes are taken by name: ``mesh["tp"]`` for tensor parallelism,
    ``mesh["dp_replicate", "dp_shard"]`` (HSDP) or ``mesh["dp_shard"]`` for FSDP2. The
    flattened one spans all data-parallel ranks: token counts, the loss and the data slice.
    """
    names, sizes = zip(*dims.mesh_dims)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh, dp_mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """2-D (replicate, shard) for HSDP, else the 1-D shard dimension."""
    return mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
