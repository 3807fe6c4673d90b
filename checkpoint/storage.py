"""How tensors lie in a checkpoint's files: raw bytes, read straight into the destination.

DCP keeps the plan (who saves which chunk, who loads which part, resharding) and the
``.metadata`` file; this module only changes the bytes of each rank's data file. Stock DCP
wraps every tensor in a ``torch.save`` archive, so a load deserialises each one into fresh
memory and copies it again into the live tensor: three memory passes per byte, CPU-bound at
a fraction of disk speed. Here a tensor chunk is its C-order bytes, so a load is one
``readinto`` into the destination tensor's own memory when the request covers whole rows of
the saved chunk and the destination is a contiguous CPU tensor (every same-layout resume,
and dim-0 resharding); anything else goes through a scratch buffer and one ``copy_``.

Checksums ride along with the bytes: the writer hashes what it writes (no read-back to
acknowledge a file), and the reader hashes the files it was asked to verify while it streams
them in order, so verification costs no extra pass over the disk. A file that fails is
reported in ``RawFileReader.problems`` after the load; the destination tensors then hold
a mix of old and new bytes and the caller must load another checkpoint or stop
(checkpoint/loader.py does). Pickled (BYTE_IO) items are small; they are unpickled only after
every file this rank verifies has passed.

Tensor entries carry the transform descriptor ``raw-bytes`` in DCP's metadata. Stock
``FileSystemReader`` refuses them (``Unknown extension``) rather than misread them; tensors
written by stock DCP (``torch.save`` items, no descriptor) are still read, through DCP's own
path.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint.integrity import hasher
from checkpoint.manifest import FileEntry

RAW = "raw-bytes"
SCRATCH = 16 << 20  # bytes read (and hashed) at a time where nothing needs them


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _done(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _write_all(f, mv: memoryview) -> None:
    while len(mv):
        mv = mv[f.write(mv):]


def _read_exact(f, mv: memoryview) -> bool:
    """Fill ``mv`` from ``f``'s position; False at a premature end of file."""
    while len(mv):
        n = f.readinto(mv)
        if not n:
            return False
        mv = mv[n:]
    return True


class _Hashing:
    """A file's running checksum, computed on a helper thread (xxhash releases the GIL), so
    hashing block i overlaps reading block i+1. Updates are applied in submission order."""

    def __init__(self, algorithm: str, pool: ThreadPoolExecutor):
        self._h, self._pool = hasher(algorithm), pool
        self._last: Optional[Future] = None

    def update(self, mv: memoryview) -> Future:
        """Queue ``mv``; it must not change until the returned future is done."""
        self._last = self._pool.submit(self._apply, self._last, mv)
        return self._last

    def _apply(self, prev: Optional[Future], mv: memoryview) -> None:
        if prev is not None:
            prev.result()
        self._h.update(mv)

    def wait(self) -> None:
        if self._last is not None:
            self._last.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._h.hexdigest()


class RawFileWriter(FileSystemWriter):
    """One file per rank, tensors as raw bytes; ``written`` holds each file's size and checksum."""

    def __init__(self, path, checksum_algorithm: Optional[str], sync_files: bool = True):
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self.checksum_algorithm = checksum_algorithm
        self.written: Dict[str, FileEntry] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
            h = _Hashing(self.checksum_algorithm, pool) if self.checksum_algorithm else None
            results, size = self._write_file(Path(self.path) / name, name, plan, planner, h)
            self.written[name] = FileEntry(size=size, checksum=h.hexdigest() if h is not None else None)
        return _done(results)

    def _write_file(self, path: Path, name: str, plan: SavePlan, planner: SavePlanner,
                    h: Optional[_Hashing]) -> Tuple[List[WriteResult], int]:
        """Write every item back to back (hashing each while the next is written); fsync."""
        results: List[WriteResult] = []
        offset = 0
        with open(path, "wb", buffering=8 << 20) as f:
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
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        return results, offset


@dataclasses.dataclass
class _Request:
    """One read item as a byte span of its file, and where its bytes go."""

    req: ReadItem
    start: int
    end: int
    slab: Tuple[int, ...]  # shape of the rows read: (rows, *saved_sizes[1:])
    dtype: Optional[torch.dtype]  # None for BYTE_IO


class RawFileReader(FileSystemReader):
    """Reads raw-bytes tensors into their destinations; verifies the files in ``verify``
    (name -> expected size and checksum, all with ``algorithm``) while reading them."""

    def __init__(self, path, verify: Optional[Dict[str, FileEntry]] = None, algorithm: Optional[str] = None):
        super().__init__(path)
        self.verify = dict(verify or {})
        self.algorithm = algorithm
        self.problems: List[str] = []
        self._chunks: Dict[MetadataIndex, Tuple[Tuple[int, ...], torch.dtype]] = {}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[MetadataIndex(fqn, chunk.offsets)] = (tuple(chunk.sizes), md.properties.dtype)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        raw: Dict[str, List[_Request]] = {}
        legacy: List[ReadItem] = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                raw.setdefault(info.relative_path, []).append(
                    _Request(req, info.offset, info.offset + info.length, (), None))
            elif list(info.transform_descriptors or ()) == [RAW]:
                raw.setdefault(info.relative_path, []).append(self._tensor_request(req, info))
            else:
                legacy.append(req)
        if legacy:  # written by stock DCP: its own deserialising path
            super().read_data(dataclasses.replace(plan, items=legacy), planner)
        pickled: List[Tuple[ReadItem, bytes]] = []
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
            for name in sorted(set(raw) | set(self.verify)):
                self._read_file(name, sorted(raw.get(name, []), key=lambda r: (r.start, r.end)), planner,
                                pickled, pool)
        for req, blob in pickled:
            if self.problems:
                break  # never unpickle from a checkpoint that failed verification
            try:
                planner.load_bytes(req, io.BytesIO(blob))
            except Exception as exc:  # corrupt bytes in a file another rank verifies
                self.problems.append(f"{req.storage_index.fqn}: cannot unpickle ({type(exc).__name__}: {exc})")
        return _done(None)

    # -- one file ------------------------------------------------------------------------------
    def _tensor_request(self, req: ReadItem, info: _StorageInfo) -> _Request:
        sizes, dtype = self._chunks[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
        if not sizes:  # 0-dim
            return _Request(req, info.offset, info.offset + info.length, (), dtype)
        row = math.prod(sizes[1:]) * dtype.itemsize
        first, rows = req.storage_offsets[0], req.lengths[0]
        start = info.offset + first * row
        return _Request(req, start, start + rows * row, (rows, *sizes[1:]), dtype)

    def _read_file(self, name: str, requests: List[_Request], planner: LoadPlanner,
                   pickled: List[Tuple[ReadItem, bytes]], pool: ThreadPoolExecutor) -> None:
        expected = self.verify.get(name)
        h = _Hashing(self.algorithm, pool) if expected is not None and expected.checksum else None
        path = Path(self.path) / name
        try:
            f = open(path, "rb", buffering=0)
        except OSError as exc:
            self.problems.append(f"{name}: {exc}")
            return
        with f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            pos = 0  # with a checksum: every byte before pos has been hashed, in order
            scratch = None
            for r in requests:
                if h is not None and r.start < pos:  # overlaps what was hashed: read it aside
                    self._deliver(f, r, planner, pickled, None)
                    continue
                if h is not None and r.start > pos:
                    scratch = self._skip(f, pos, r.start, h, scratch)
                if not self._deliver(f, r, planner, pickled, h):
                    self.problems.append(f"{name}: ends before byte {r.end} (truncated)")
                    return
                pos = max(pos, r.end)
            if expected is None:
                return
            size = os.fstat(f.fileno()).st_size
            if size != expected.size:
                self.problems.append(f"{name}: {size} bytes, the manifest says {expected.size}")
            elif h is not None:
                self._skip(f, pos, size, h, scratch)
                got = h.hexdigest()
                if got != expected.checksum:
                    self.problems.append(f"{name}: {self.algorithm} checksum {got}, the manifest says "
                                         f"{expected.checksum}")

    def _skip(self, f, start: int, end: int, h: _Hashing, scratch: Optional[List[bytearray]]):
        """Read and hash [start, end): bytes this rank does not need but must verify. Two
        alternating buffers, so one is hashed while the other is filled."""
        scratch = scratch or [bytearray(SCRATCH), bytearray(SCRATCH)]
        pending: List[Optional[Future]] = [None, None]
        f.seek(start)
        i = 0
        while start < end:
            if pending[i] is not None:
                pending[i].result()  # this buffer's previous contents are hashed: refill it
            buf = memoryview(scratch[i])[: min(SCRATCH, end - start)]
            if not _read_exact(f, buf):
                break
            pending[i] = h.update(buf)
            start += len(buf)
            i = 1 - i
        h.wait()
        return scratch

    def _deliver(self, f, r: _Request, planner: LoadPlanner, pickled: List[Tuple[ReadItem, bytes]],
                 h: Optional[_Hashing]) -> bool:
        """Read one request's bytes (hashing them when ``h``) and place them; False if the file is short."""
        f.seek(r.start)
        req = r.req
        if r.dtype is None:
            blob = bytearray(r.end - r.start)
            if not _read_exact(f, memoryview(blob)):
                return False
            if h is not None:
                h.update(memoryview(blob))
            pickled.append((req, bytes(blob)))
            return True
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise AssertionError(f"{req.storage_index.fqn}: destination {tuple(target.shape)} for a read of "
                                 f"{tuple(req.lengths)}")
        whole_rows = tuple(req.lengths[1:]) == r.slab[1:] and all(o == 0 for o in req.storage_offsets[1:])
        direct = (whole_rows and target.device.type == "cpu" and target.dtype == r.dtype
                  and target.is_contiguous())
        if direct:
            dest = tensor_bytes(target)
        else:
            buf = torch.empty(r.end - r.start, dtype=torch.uint8)
            dest = tensor_bytes(buf)
        if not _read_exact(f, dest):
            return False
        if h is not None:
            h.update(dest)
        if not direct:
            src = buf.view(r.dtype).reshape(r.slab) if r.slab else buf.view(r.dtype).reshape(())
            for dim in range(1, len(r.slab)):
                src = src.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
            target.copy_(src)
        planner.commit_tensor(req, target)
        return True
