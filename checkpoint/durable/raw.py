"""How tensors lie in a checkpoint's files: raw bytes, read straight into the destination.

DCP keeps the plan (who saves which chunk, who loads which part, resharding) and the
``.metadata`` file; this module only changes the bytes of each rank's data file. Stock DCP
wraps every tensor in a ``torch.save`` archive, so a load deserialises each one into fresh
memory and copies it again into the live tensor: three memory passes per byte, CPU-bound at
a fraction of disk speed. Here a tensor chunk is its C-order bytes, so a load is one
``readinto`` into the destination tensor's own memory when the request covers whole rows of
the saved chunk and the destination is a contiguous CPU tensor (every same-layout resume,
and dim-0 resharding); anything else goes through a scratch buffer and one ``copy_``.
Each file is read by several streams (``threads``), each a contiguous byte range.

Checksums ride along with the bytes: the writer hashes what it writes (no read-back to
acknowledge a file), and the reader hashes the files it was asked to verify, in file order,
as the streams deliver the bytes, so verification costs no extra pass over the disk. A file that fails is
reported in ``RawFileReader.problems`` after the load; the destination tensors then hold
a mix of old and new bytes and the caller must load another checkpoint or stop
(checkpoint/durable/loader.py does). Pickled (BYTE_IO) items are small; they are unpickled only after
every file this rank verifies has passed.

Tensor entries carry the transform descriptor ``raw-bytes`` in DCP's metadata. Stock
``FileSystemReader`` refuses them (``Unknown extension``) rather than misread them; tensors
written by stock DCP (``torch.save`` items, no descriptor) are still read, through DCP's own
path.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Tuple

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
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
            h = _Hashing(self.checksum_algorithm, pool) if self.checksum_algorithm else None
            results, size = self._write_file(self.path / name, name, plan, planner, h)
            self.written[name] = FileEntry(size=size, checksum=h.hexdigest() if h is not None else None)
        return _done(results)

    def _write_file(self, path, name: str, plan: SavePlan, planner: SavePlanner,
                    h: Optional[_Hashing]) -> Tuple[List[WriteResult], int]:
        """Write every item back to back (hashing each while the next is written); durable when closed."""
        results: List[WriteResult] = []
        offset = 0
        with path.open("wb") as f:
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
        return results, offset
