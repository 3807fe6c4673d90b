"""DCP's writer on any store, and the writer of stock DCP's data files (``checkpoint.format=dcp``); ``RAW``
is the transform descriptor of a raw-bytes tensor (``checkpoint.format=raw``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint.durable.manifest import FileEntry
from checkpoint.storage.dcp import use_store, write_metadata

RAW = "raw-bytes"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _done(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class _StoreWriter(FileSystemWriter):
    """DCP's writer on any store (checkpoint/storage/dcp.py), one file per rank. A file is durable when its
    stream closes, so DCP's own fsync is off; ``.metadata`` is one atomic write."""

    def __init__(self, path, checksum_algorithm: Optional[str] = None):
        super().__init__(str(path), single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        use_store(self, path)
        self.checksum_algorithm = checksum_algorithm
        self.written: Dict[str, FileEntry] = {}  # name -> size and checksum, for the files hashed while written

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        write_metadata(self.path, metadata)


class StockFileWriter(_StoreWriter):
    """checkpoint.format=dcp: stock DCP's data files (a ``torch.save`` archive per tensor chunk),
    one per rank, which FileSystemReader, ``dcp_to_torch_save`` and other DCP tools read. It does
    not hash while writing (``written`` stays empty): the acknowledgement reads each file back to
    checksum it, and a load deserialises every tensor (docs/checkpoint-format.md has the cost)."""

