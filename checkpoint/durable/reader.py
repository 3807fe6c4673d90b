"""Reading a checkpoint's data files: raw-bytes tensors straight into their destinations.

The format and why it is raw bytes: checkpoint/durable/writer.py. ``RawFileReader`` is a DCP
StorageReader; DCP plans which saved chunks each rank needs (resharding), and this reader turns
each file's requests into byte ranges (checkpoint/durable/segments.py) read by ``threads``
streams, hashing the files it was asked to verify as the bytes arrive.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from checkpoint.durable.manifest import REREAD_DELAY_S, FileEntry, checksum_file
from checkpoint.durable.segments import (
    Request,
    hash_in_order,
    plan_segments,
    read_segments,
    split_streams,
    stream_count,
)
from checkpoint.durable.writer import RAW, _done
from checkpoint.storage.dcp import use_store


class RawFileReader(FileSystemReader):
    """Reads raw-bytes tensors into their destinations with ``threads`` read streams per file;
    verifies the files in ``verify`` (name -> expected size and checksum, all with
    ``algorithm``) while reading them.

    What goes wrong is sorted as inspect_files sorts it (checkpoint/durable/manifest.py):
    ``problems`` is proven damage (a file missing twice, cut short, hashing wrong on a second
    read); ``unreadable`` is the storage failing (an I/O error, a hash right on the second read).
    ``fault(path)``, called before each file is opened, is the fault injector's read point."""

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
        streams = stream_count(segments, self.threads)
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
