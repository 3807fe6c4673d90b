"""safetensors files written and read a tensor (or a slice) at a time.

Writing: the ``safetensors`` package saves a dict of tensors held in memory; an export of a
large model cannot hold them all. A safetensors file is an 8-byte header length, a JSON header
(every tensor's dtype, shape and byte range) and the tensors' bytes back to back, and the
export knows every name, dtype and shape before it reads a byte (DCP's metadata), so
``SafetensorsFile`` writes the header first and then each tensor as it arrives, converting
the dtype a block at a time: memory stays at one tensor.

Reading: ``SafetensorsReader`` is a DCP StorageReader over safetensors files (a Hugging Face
folder or this project's export). DCP's planner asks each rank for the parts of each tensor
that rank holds (FSDP2 and tensor-parallel shards alike) and the reader fetches exactly those
rows and columns with safetensors' ``get_slice``; Hugging Face's q/k rows are put back into
Meta's rotary order on the way (whole heads are read, so a shard that starts mid-head costs
at most one extra head of rows).

Not torch's HuggingFaceStorageWriter / HuggingFaceStorageReader: the writer holds every tensor at once,
the reader cannot give a shard part of a head's q/k rows (measured and shown in docs/interop.md).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from model.hf import from_hf_rows

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
FROM_NAME = {v: k for k, v in DTYPES.items()}
BLOCK = 64 << 20  # bytes converted and written at a time


def parse_size(text: str | int) -> int:
    """"5GB" (10^9, as Hugging Face counts), "5GiB", "500MB", or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"--max-shard-size={text!r}: use bytes or a size such as 5GB, 500MB, 2GiB")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base ** power)


@dataclass
class TensorSpec:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsFile:
    """One safetensors file written tensor by tensor, in the order of ``specs``."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: Optional[Dict[str, str]] = None):
        self.path, self.specs = Path(path), list(specs)
        header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for s in self.specs:
            header[s.name] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset,
                                                                                                 offset + s.nbytes]}
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
        self._f = open(self.path, "wb")
        self._f.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{self.path}: expected {spec.name} {spec.shape}, got {name} {tuple(tensor.shape)}")
        flat = tensor.detach().reshape(-1)
        step = max(1, BLOCK // max(flat.element_size(), spec.dtype.itemsize))
        for block in flat.split(step):
            out = block.to(spec.dtype).contiguous()
            self._f.write(memoryview(out.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensors were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


@dataclass
class SourceTensor:
    """Where one of our tensors comes from: a file, its name there, and (for HF's q/k) the heads to reorder."""

    file: Path
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    heads: Optional[int] = None


class SafetensorsReader(StorageReader):
    """Serves our tensor names (``tensors``) from safetensors files to ``dcp.load``; counts the
    bytes it reads (``bytes_read``)."""

    def __init__(self, tensors: Dict[str, SourceTensor]):
        super().__init__()
        self.tensors = tensors
        self.bytes_read = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = {}
        for name, t in self.tensors.items():
            size = torch.Size(t.shape)
            md[name] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), size,
                                             [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        from safetensors import safe_open

        by_file: Dict[Path, List[ReadItem]] = {}
        for req in plan.items:
            by_file.setdefault(self.tensors[req.storage_index.fqn].file, []).append(req)
        for path, reqs in sorted(by_file.items()):
            with safe_open(str(path), framework="pt") as f:
                for req in reqs:
                    src = self._read(f, req)
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(src)
                    planner.commit_tensor(req, target)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _read(self, f, req: ReadItem) -> torch.Tensor:
        """The requested box of one tensor, in Meta's row order."""
        t = self.tensors[req.storage_index.fqn]
        box = [slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths)]
        if t.heads is None or not box:
            out = f.get_slice(t.name)[tuple(box)] if box else f.get_tensor(t.name)
            self.bytes_read += out.numel() * out.element_size()
            return out
        head = t.shape[0] // t.heads  # whole heads around the rows asked for, reordered, cut to the rows
        first, end = box[0].start // head, -(-box[0].stop // head)
        rows = f.get_slice(t.name)[(slice(first * head, end * head), *box[1:])]
        self.bytes_read += rows.numel() * rows.element_size()
        return from_hf_rows(rows, end - first)[box[0].start - first * head:box[0].stop - first * head]


def source_tensors(header_entries: Dict[str, Tuple[Path, Dict]], names: Dict[str, str],
                   heads: Dict[str, Optional[int]]) -> Dict[str, SourceTensor]:
    """Our name -> SourceTensor, for ``names`` (our name -> its name in the files) found in the headers."""
    out = {}
    for ours, theirs in names.items():
        file, entry = header_entries[theirs]
        out[ours] = SourceTensor(file, theirs, tuple(entry["shape"]), FROM_NAME[entry["dtype"]], heads.get(ours))
    return out
