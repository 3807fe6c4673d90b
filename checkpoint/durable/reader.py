"""Reading a checkpoint's data files: raw-bytes tensors straight into their destinations.

The format and why it is raw bytes: docs/checkpoint-format.md. ``RawFileReader`` is a DCP StorageReader:
DCP plans which saved chunks each rank needs (resharding); this reader turns each file's requests into
byte segments read by ``threads`` streams. When the file is this rank's to verify, the bytes between the
requests (gaps) are read too, only to be hashed: a hashing thread consumes the segments in file order as
the streams deliver them, so verification costs no second pass over the disk.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from checkpoint.durable.manifest import REREAD_DELAY_S, FileEntry, checksum_file, hasher
from checkpoint.durable.writer import RAW, _done, tensor_bytes
from checkpoint.storage import location
from checkpoint.storage.dcp import use_store

SCRATCH = 16 << 20  # bytes read (and hashed) at a time where nothing needs them
GAP_LIMIT = 64 << 20  # gap bytes per file that parallel streams may hold until they are hashed


class RawFileReader(FileSystemReader):
    """Reads raw-bytes tensors into their destinations with ``threads`` read streams per file, and
    verifies the files in ``verify`` (name -> size and checksum with ``algorithm``) while reading them.
    As inspect_files sorts them (manifest.py): ``problems`` is proven damage, ``unreadable`` the storage
    failing. ``fault(path)``, called before each file is opened, is the fault injector's read point."""

    def __init__(self, path, verify: Optional[Dict[str, FileEntry]] = None, algorithm: Optional[str] = None,
                 threads: int = 2, fault: Optional[Callable[[Path], None]] = None):
        super().__init__(str(path))
        use_store(self, path)
        if threads < 1:
            raise ValueError(f"checkpoint.load_threads={threads}: need at least 1 read stream")
        self.verify = dict(verify or {})
        self.algorithm = algorithm
        self.threads = threads
        self.fault = fault
        self.problems: List[str] = []
        self.unreadable: List[str] = []
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
        raw: Dict[str, List[Request]] = {}
        legacy: List[ReadItem] = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                raw.setdefault(info.relative_path, []).append(
                    Request(req, info.offset, info.offset + info.length, (), None))
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

    def _hashed_wrong(self, path: Path, name: str, got: str, expected: str) -> None:
        """A file hashed wrong as it streamed: read it whole once more before calling it damaged."""
        time.sleep(REREAD_DELAY_S)
        try:
            again = checksum_file(path, self.algorithm)
        except OSError as exc:
            self.unreadable.append(f"{name}: hashed {got} while loading, then {exc}")
            return
        if again == expected:
            self.unreadable.append(f"{name}: the bytes read while loading hashed {got}, the file on disk hashes "
                                   f"right: a bad read, not damage")
        else:
            self.problems.append(f"{name}: {self.algorithm} checksum {again} (read twice), the manifest says "
                                 f"{expected}")

    def _tensor_request(self, req: ReadItem, info: _StorageInfo) -> Request:
        sizes, dtype = self._chunks[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
        if not sizes:  # 0-dim
            return Request(req, info.offset, info.offset + info.length, (), dtype)
        row = math.prod(sizes[1:]) * dtype.itemsize
        first, rows = req.storage_offsets[0], req.lengths[0]
        start = info.offset + first * row
        return Request(req, start, start + rows * row, (rows, *sizes[1:]), dtype)

    # -- one file ------------------------------------------------------------------------------
    def _read_file(self, name: str, requests: List[Request], planner: LoadPlanner,
                   pickled: List[Tuple[ReadItem, bytes]], hash_pool: ThreadPoolExecutor,
                   read_pool: ThreadPoolExecutor) -> None:
        """Read ``requests`` from ``name``, hashing the whole file in order when it is ours to
        verify. The segments are split into contiguous byte ranges, one per read stream (a
        virtual disk measured 1.6-2.3x faster with two streams than with one). Gaps (bytes
        this rank reads only to hash them) are bounded: past GAP_LIMIT a single stream reads
        them through two recycled buffers."""
        path = self.path / name
        try:
            if self.fault is not None:
                self.fault(path)
            size = path.stat().st_size
        except FileNotFoundError as exc:
            time.sleep(REREAD_DELAY_S)
            (self.unreadable if path.exists() else self.problems).append(f"{name}: {exc}")
            return
        except OSError as exc:
            self.unreadable.append(f"{name}: {exc}")
            return
        expected = self.verify.get(name)
        if expected is not None and size != expected.size:
            self.problems.append(f"{name}: {size} bytes, the manifest says {expected.size}")
        hashing = expected is not None and expected.checksum is not None and size == expected.size
        segments, aside = plan_segments(requests, size if hashing else None)
        gaps = sum(s.end - s.start for s in segments if s.request is None)
        streams = self.threads if gaps <= GAP_LIMIT else 1
        for seg in segments + aside:  # the planner is DCP's: only this thread talks to it
            r = seg.request
            if r is not None and r.dtype is not None:
                seg.target = planner.resolve_tensor(r.req).detach()
                if tuple(seg.target.shape) != tuple(r.req.lengths):
                    raise AssertionError(f"{r.req.storage_index.fqn}: destination {tuple(seg.target.shape)} for "
                                         f"a read of {tuple(r.req.lengths)}")
        digest = hash_pool.submit(hash_in_order, segments, self.algorithm) if hashing else None
        reads = [read_pool.submit(read_segments, path, group, recycle=streams == 1)
                 for group in split_streams(segments, streams)]
        errors = [e for e in (r.result() for r in reads) if e]
        if aside:  # requests overlapping bytes already hashed: read on their own
            errors += [e for e in [read_segments(path, aside, recycle=False)] if e]
        for e in errors:
            (self.unreadable if isinstance(e, OSError) else self.problems).append(f"{name}: {e}")
        if digest is not None:
            got = digest.result()
            if not errors and got != expected.checksum:
                self._hashed_wrong(path, name, got, expected.checksum)
        for seg in sorted(segments + aside, key=lambda x: x.start):
            r = seg.request
            if r is None or not seg.read.result():
                continue
            if r.dtype is None:
                pickled.append((r.req, bytes(seg.blob)))
            else:
                planner.commit_tensor(r.req, seg.target)


# -- the read plan of one file: byte segments, their streams, the checksum in file order ----
def read_exact(f, mv: memoryview) -> bool:
    """Fill ``mv`` from ``f``'s position; False at a premature end of file."""
    while len(mv):
        n = f.readinto(mv)
        if not n:
            return False
        mv = mv[n:]
    return True


@dataclasses.dataclass
class Request:
    """One read item as a byte span of its file, and where its bytes go."""

    req: ReadItem
    start: int
    end: int
    slab: Tuple[int, ...]  # shape of the rows read: (rows, *saved_sizes[1:])
    dtype: Optional[torch.dtype]  # None for BYTE_IO


@dataclasses.dataclass
class Segment:
    """A byte span read as one unit: a request, or a gap (bytes read only to be hashed)."""

    start: int
    end: int
    request: Optional[Request] = None
    target: Optional[torch.Tensor] = None  # the resolved destination of a tensor request
    blob: Optional[bytearray] = None  # the bytes of a pickled request
    staging: Optional[torch.Tensor] = None  # rows read aside, when they cannot land in the target
    read: Future = dataclasses.field(default_factory=Future)  # -> memoryview of its bytes; None: file too short
    hashed: Future = dataclasses.field(default_factory=Future)


def plan_segments(requests: List[Request], hashed_size: Optional[int]) -> Tuple[List[Segment], List[Segment]]:
    """Segments in file order; with ``hashed_size``, gaps too (in pieces of at most SCRATCH),
    so that the segments cover [0, hashed_size). Requests overlapping one before go aside."""
    segments: List[Segment] = []
    aside: List[Segment] = []
    pos = 0

    def gap(start: int, end: int) -> None:
        for a in range(start, end, SCRATCH):
            segments.append(Segment(a, min(end, a + SCRATCH)))

    for r in requests:
        if r.start < pos:
            if hashed_size is not None:
                aside.append(Segment(r.start, r.end, r))
                continue
        elif hashed_size is not None:
            gap(pos, r.start)
        segments.append(Segment(r.start, r.end, r))
        pos = max(pos, r.end)
    if hashed_size is not None:
        gap(pos, hashed_size)
    return segments, aside


def split_streams(segments: List[Segment], streams: int) -> List[List[Segment]]:
    """``streams`` runs of consecutive segments with about equal bytes each."""
    total = sum(s.end - s.start for s in segments)
    groups: List[List[Segment]] = [[] for _ in range(streams)]
    done = 0
    for seg in segments:
        groups[min(streams - 1, done * streams // max(total, 1))].append(seg)
        done += seg.end - seg.start
    return [g for g in groups if g]


def read_segments(path: Path, segments: List[Segment], recycle: bool) -> Union[None, str, OSError]:
    """Read ``segments`` in order through one file handle (its own readahead); None, or what
    went wrong: the OSError the storage raised, or a text when the file ends early. Every
    segment's ``read`` future is resolved, whatever happens."""
    gaps = _GapBuffers(recycle)
    try:
        with location(path).open("rb") as f:
            try:  # a local file: tell the kernel to read ahead (a stream without a descriptor has no kernel to tell)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (OSError, AttributeError):
                pass
            for seg in segments:
                mv = gaps.get(seg) if seg.request is None else _request_memory(seg)
                f.seek(seg.start)
                if not read_exact(f, mv):
                    return f"ends before byte {seg.end} (truncated)"
                if seg.staging is not None:
                    _place(seg)
                seg.read.set_result(mv)
        return None
    except OSError as exc:
        return exc
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

    def get(self, seg: Segment) -> memoryview:
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


def _request_memory(seg: Segment) -> memoryview:
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


def _place(seg: Segment) -> None:
    """Copy the part of the rows read that the destination wants into it."""
    r, buf = seg.request, seg.staging
    src = buf.view(r.dtype).reshape(r.slab) if r.slab else buf.view(r.dtype).reshape(())
    for dim in range(1, len(r.slab)):
        src = src.narrow(dim, r.req.storage_offsets[dim], r.req.lengths[dim])
    seg.target.copy_(src)


def hash_in_order(segments: List[Segment], algorithm: str) -> Optional[str]:
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
