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
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from checkpoint.durable.integrity import hasher
from checkpoint.durable.manifest import FileEntry

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


class StockFileWriter(FileSystemWriter):
    """checkpoint.format=dcp: stock DCP's data files (a ``torch.save`` archive per tensor chunk),
    one per rank, which FileSystemReader, ``dcp_to_torch_save`` and other DCP tools read. It does
    not hash while writing (``written`` stays empty): the acknowledgement reads each file back to
    checksum it, and a load deserialises every tensor (docs/checkpoint-format.md has the cost)."""

    def __init__(self, path, checksum_algorithm: Optional[str] = None, sync_files: bool = True):
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self.written: Dict[str, FileEntry] = {}


WRITERS = {"raw": RawFileWriter, "dcp": StockFileWriter}  # checkpoint.format -> the writer of the data files


@dataclasses.dataclass
class _Request:
    """One read item as a byte span of its file, and where its bytes go."""

    req: ReadItem
    start: int
    end: int
    slab: Tuple[int, ...]  # shape of the rows read: (rows, *saved_sizes[1:])
    dtype: Optional[torch.dtype]  # None for BYTE_IO


@dataclasses.dataclass
class _Segment:
    """A byte span read as one unit: a request, or a gap (bytes read only to be hashed)."""

    start: int
    end: int
    request: Optional[_Request] = None
    target: Optional[torch.Tensor] = None  # the resolved destination of a tensor request
    blob: Optional[bytearray] = None  # the bytes of a pickled request
    staging: Optional[torch.Tensor] = None  # rows read aside, when they cannot land in the target
    read: Future = dataclasses.field(default_factory=Future)  # -> memoryview of its bytes; None: file too short
    hashed: Future = dataclasses.field(default_factory=Future)


class RawFileReader(FileSystemReader):
    """Reads raw-bytes tensors into their destinations with ``threads`` read streams per file;
    verifies the files in ``verify`` (name -> expected size and checksum, all with
    ``algorithm``) while reading them."""

    def __init__(self, path, verify: Optional[Dict[str, FileEntry]] = None, algorithm: Optional[str] = None,
                 threads: int = 2):
        super().__init__(path)
        if threads < 1:
            raise ValueError(f"checkpoint.load_threads={threads}: need at least 1 read stream")
        self.verify = dict(verify or {})
        self.algorithm = algorithm
        self.threads = threads
        self.problems: List[str] = []
        self._chunks: Dict[MetadataIndex, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """DCP's index, read once: the loader inspects it before ``dcp.load`` asks again."""
        if kwargs.get("rank") is not None:  # a per-rank index (no collectives): not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta.load_id = self.load_id  # DCP's reset() draws a new one
        return self._metadata

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
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as hash_pool, \
                ThreadPoolExecutor(self.threads, thread_name_prefix="checkpoint-read") as read_pool:
            for name in sorted(set(raw) | set(self.verify)):
                requests = sorted(raw.get(name, []), key=lambda r: (r.start, r.end))
                self._read_file(name, requests, planner, pickled, hash_pool, read_pool)
        for req, blob in pickled:
            if self.problems:
                break  # never unpickle from a checkpoint that failed verification
            try:
                planner.load_bytes(req, io.BytesIO(blob))
            except Exception as exc:  # corrupt bytes in a file another rank verifies
                self.problems.append(f"{req.storage_index.fqn}: cannot unpickle ({type(exc).__name__}: {exc})")
        return _done(None)

    def _tensor_request(self, req: ReadItem, info: _StorageInfo) -> _Request:
        sizes, dtype = self._chunks[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
        if not sizes:  # 0-dim
            return _Request(req, info.offset, info.offset + info.length, (), dtype)
        row = math.prod(sizes[1:]) * dtype.itemsize
        first, rows = req.storage_offsets[0], req.lengths[0]
        start = info.offset + first * row
        return _Request(req, start, start + rows * row, (rows, *sizes[1:]), dtype)

    # -- one file ------------------------------------------------------------------------------
    def _read_file(self, name: str, requests: List[_Request], planner: LoadPlanner,
                   pickled: List[Tuple[ReadItem, bytes]], hash_pool: ThreadPoolExecutor,
                   read_pool: ThreadPoolExecutor) -> None:
        """Read ``requests`` from ``name``, hashing the whole file in order when it is ours to
        verify. The segments are split into contiguous byte ranges, one per read stream (a
        virtual disk measured 1.6-2.3x faster with two streams than with one). Gaps (bytes
        this rank reads only to hash them) are bounded: past GAP_LIMIT a single stream reads
        them through two recycled buffers."""
        path = Path(self.path) / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            self.problems.append(f"{name}: {exc}")
            return
        expected = self.verify.get(name)
        if expected is not None and size != expected.size:
            self.problems.append(f"{name}: {size} bytes, the manifest says {expected.size}")
        hashing = expected is not None and expected.checksum is not None and size == expected.size
        segments, aside = _plan_segments(requests, size if hashing else None)
        gaps = sum(s.end - s.start for s in segments if s.request is None)
        streams = self.threads if gaps <= GAP_LIMIT else 1
        for seg in segments + aside:  # the planner is DCP's: only this thread talks to it
            r = seg.request
            if r is not None and r.dtype is not None:
                seg.target = planner.resolve_tensor(r.req).detach()
                if tuple(seg.target.shape) != tuple(r.req.lengths):
                    raise AssertionError(f"{r.req.storage_index.fqn}: destination {tuple(seg.target.shape)} for "
                                         f"a read of {tuple(r.req.lengths)}")
        digest = hash_pool.submit(_hash_in_order, segments, self.algorithm) if hashing else None
        reads = [read_pool.submit(_read_segments, path, group, recycle=streams == 1)
                 for group in _split(segments, streams)]
        errors = [e for e in (r.result() for r in reads) if e]
        if aside:  # requests overlapping bytes already hashed: read on their own
            errors += [e for e in [_read_segments(path, aside, recycle=False)] if e]
        for e in errors:
            self.problems.append(f"{name}: {e}")
        if digest is not None:
            got = digest.result()
            if not errors and got != expected.checksum:
                self.problems.append(f"{name}: {self.algorithm} checksum {got}, the manifest says {expected.checksum}")
        for seg in sorted(segments + aside, key=lambda x: x.start):
            r = seg.request
            if r is None or not seg.read.result():
                continue
            if r.dtype is None:
                pickled.append((r.req, bytes(seg.blob)))
            else:
                planner.commit_tensor(r.req, seg.target)


GAP_LIMIT = 64 << 20  # gap bytes per file that parallel streams may hold until they are hashed


def _plan_segments(requests: List[_Request], hashed_size: Optional[int]) -> Tuple[List[_Segment], List[_Segment]]:
    """Segments in file order; with ``hashed_size``, gaps too (in pieces of at most SCRATCH),
    so that the segments cover [0, hashed_size). Requests overlapping one before go aside."""
    segments: List[_Segment] = []
    aside: List[_Segment] = []
    pos = 0

    def gap(start: int, end: int) -> None:
        for a in range(start, end, SCRATCH):
            segments.append(_Segment(a, min(end, a + SCRATCH)))

    for r in requests:
        if r.start < pos:
            if hashed_size is not None:
                aside.append(_Segment(r.start, r.end, r))
                continue
        elif hashed_size is not None:
            gap(pos, r.start)
        segments.append(_Segment(r.start, r.end, r))
        pos = max(pos, r.end)
    if hashed_size is not None:
        gap(pos, hashed_size)
    return segments, aside


def _split(segments: List[_Segment], streams: int) -> List[List[_Segment]]:
    """``streams`` runs of consecutive segments with about equal bytes each."""
    total = sum(s.end - s.start for s in segments)
    groups: List[List[_Segment]] = [[] for _ in range(streams)]
    done = 0
    for seg in segments:
        groups[min(streams - 1, done * streams // max(total, 1))].append(seg)
        done += seg.end - seg.start
    return [g for g in groups if g]


def _read_segments(path: Path, segments: List[_Segment], recycle: bool) -> Optional[str]:
    """Read ``segments`` in order through one file handle (its own readahead); None, or what
    went wrong. Every segment's ``read`` future is resolved, whatever happens."""
    gaps = _GapBuffers(recycle)
    try:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for seg in segments:
                mv = gaps.get(seg) if seg.request is None else _request_memory(seg)
                f.seek(seg.start)
                if not _read_exact(f, mv):
                    return f"ends before byte {seg.end} (truncated)"
                if seg.staging is not None:
                    _place(seg)
                seg.read.set_result(mv)
        return None
    except OSError as exc:
        return str(exc)
    finally:
        for seg in segments:
            if not seg.read.done():
                seg.read.set_result(None)


class _GapBuffers:
    """Memory for gaps: fresh for each (parallel streams, bounded by GAP_LIMIT), or two
    buffers used in turn, each refilled only once its previous contents are hashed."""

    def __init__(self, recycle: bool):
        self.recycle = recycle
        self.slots: List[list] = []  # [segment last read into it, buffer]
        self.turn = 0

    def get(self, seg: _Segment) -> memoryview:
        n = seg.end - seg.start
        if not self.recycle:
            return memoryview(bytearray(n))
        if len(self.slots) < 2:
            self.slots.append([seg, bytearray(SCRATCH)])
            return memoryview(self.slots[-1][1])[:n]
        slot = self.slots[self.turn]
        self.turn = 1 - self.turn
        slot[0].hashed.result()
        slot[0] = seg
        return memoryview(slot[1])[:n]


def _request_memory(seg: _Segment) -> memoryview:
    """Where a request's bytes go: the destination tensor itself when the read covers whole
    rows of the saved chunk and the destination is a contiguous CPU tensor of its dtype; else
    a staging buffer that ``_place`` copies from."""
    r, n, t = seg.request, seg.end - seg.start, seg.target
    if r.dtype is None:
        seg.blob = bytearray(n)
        return memoryview(seg.blob)
    whole_rows = tuple(r.req.lengths[1:]) == r.slab[1:] and all(o == 0 for o in r.req.storage_offsets[1:])
    if whole_rows and t.device.type == "cpu" and t.dtype == r.dtype and t.is_contiguous():
        return tensor_bytes(t)
    seg.staging = torch.empty(n, dtype=torch.uint8)
    return tensor_bytes(seg.staging)


def _place(seg: _Segment) -> None:
    """Copy the part of the rows read that the destination wants into it."""
    r, buf = seg.request, seg.staging
    src = buf.view(r.dtype).reshape(r.slab) if r.slab else buf.view(r.dtype).reshape(())
    for dim in range(1, len(r.slab)):
        src = src.narrow(dim, r.req.storage_offsets[dim], r.req.lengths[dim])
    seg.target.copy_(src)


def _hash_in_order(segments: List[_Segment], algorithm: str) -> Optional[str]:
    """The file's checksum from its segments in file order, each as soon as it is read."""
    h = hasher(algorithm)
    ok = True
    for seg in segments:
        mv = seg.read.result() if ok else None
        if mv is None:
            ok = False
        else:
            h.update(mv)
        seg.hashed.set_result(None)
    return h.hexdigest() if ok else None
