"""The raw-bytes data files (``checkpoint.format=raw``, the default): how tensors lie in a rank's file.

DCP keeps the plan (who saves which chunk, who loads which part, resharding) and ``.metadata``; this
writer only changes the bytes. Stock DCP wraps every tensor in a ``torch.save`` archive, so a load
deserialises each one into fresh memory and copies it again into the live tensor. Here a tensor chunk is
its C-order bytes, tagged ``raw-bytes`` in DCP's metadata, so a load is one ``readinto`` into the
destination's own memory where it can be (checkpoint/durable/reader.py); stock ``FileSystemReader``
refuses the tag rather than misread it. The writer hashes what it writes (on a helper thread), so a file
is acknowledged without being read back.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint.durable.manifest import FileEntry, hasher
from checkpoint.durable.writer import RAW, _done, _StoreWriter, tensor_bytes


def _write_all(f, mv: memoryview) -> None:
    while len(mv):
        mv = mv[f.write(mv):]


class _Hashing:
    """A file's running checksum, computed on a one-thread pool (xxhash releases the GIL), so
    hashing item i overlaps writing item i+1; the pool applies updates in submission order."""

    def __init__(self, algorithm: str, pool: ThreadPoolExecutor):
        self._h, self._pool = hasher(algorithm), pool
        self._last: Optional[Future] = None

    def update(self, mv: memoryview) -> None:
        """Queue ``mv``; it must not change until ``hexdigest`` returns."""
        self._last = self._pool.submit(self._h.update, mv)

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._h.hexdigest()


class RawFileWriter(_StoreWriter):
    """One file per rank, tensors as raw bytes; ``written`` holds each file's size and checksum."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        """Every item back to back, each hashed while the next is written; durable when closed."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results: List[WriteResult] = []
        offset = 0
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
            h = _Hashing(self.checksum_algorithm, pool) if self.checksum_algorithm else None
            with (self.path / name).open("wb") as f:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        mv, descriptors = data.getbuffer(), None
                    else:
                        t = data.detach()
                        if t.device.type != "cpu":
                            t = t.cpu()
                        mv, descriptors = tensor_bytes(t.contiguous()), [RAW]
                    _write_all(f, mv)
                    if h is not None:
                        h.update(mv)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(mv),
                                               storage_data=_StorageInfo(name, offset, len(mv), descriptors)))
                    offset += len(mv)
            self.written[name] = FileEntry(size=offset, checksum=h.hexdigest() if h is not None else None)
        return _done(results)
