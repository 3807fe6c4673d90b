"""The read plan of one data file: byte segments, their streams, and the checksum in file order.

A load asks for some byte ranges of a file (requests); when the file is this rank's to verify,
the bytes between them (gaps) are read too, only to be hashed. The segments are split into
contiguous ranges, one per read stream; a hashing thread consumes them in file order as the
streams deliver them, so verification costs no second pass over the disk.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint.durable.manifest import hasher
from checkpoint.durable.writer import tensor_bytes
from checkpoint.storage import location

SCRATCH = 16 << 20  # bytes read (and hashed) at a time where nothing needs them


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


GAP_LIMIT = 64 << 20  # gap bytes per file that parallel streams may hold until they are hashed


def stream_count(segments: List[Segment], threads: int) -> int:
    """How many streams read a file: ``threads``, or one when its gaps exceed GAP_LIMIT (a single
    stream then reads them through two recycled buffers, so memory stays bounded)."""
    gaps = sum(s.end - s.start for s in segments if s.request is None)
    return threads if gaps <= GAP_LIMIT else 1


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
