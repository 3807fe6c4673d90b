"""Offline reading of a checkpoint's tensors without the training setup (no process group).

DCP's metadata gives every tensor's global shape and dtype, so tensors are rebuilt whole
on one CPU process whatever layout wrote them; this is what scripts/export.py consolidates.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Dict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.manifest import verify_checkpoint
from checkpoint.storage import RawFileReader

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def load_tensors(path: Path, prefix: str = "model.", verify: bool = True) -> Dict[str, torch.Tensor]:
    """{name without prefix: full tensor} for every saved tensor whose key starts with ``prefix``."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    reader = RawFileReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not sd:
        kinds = sorted({k.split(".")[0] for k in meta})
        raise KeyError(f"{path} has no tensors under '{prefix}' (components: {kinds})")
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in sd.items()}
