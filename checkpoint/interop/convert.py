"""Convert a committed raw-format checkpoint into stock DCP's format (scripts/convert_checkpoint.py).

The saved layout is kept: every rank file becomes a rank file of the same name, every saved
chunk a chunk at the same place in DCP's metadata, so the result still reshards on load. Only
the bytes change: a raw-bytes chunk becomes a ``torch.save`` archive of that chunk (what stock
``FileSystemWriter`` writes), pickled items are copied as they are. One chunk is in memory at
a time. The output is a committed checkpoint of its own (manifest.json with the new files'
sizes and checksums), so this project resumes, exports and imports it like any other, and
``torch.distributed.checkpoint`` reads it without this project (``FileSystemReader``,
``format_utils.dcp_to_torch_save``). Other files the manifest lists (the tokenizer a checkpoint converted
from a Hugging Face folder keeps, from_hf.py) are copied as they are.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from checkpoint.durable.manifest import FileEntry, checksum_file, verify_checkpoint
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.saver import commit_checkpoint
from checkpoint.durable.writer import RAW
from checkpoint.storage import location
from checkpoint.storage.dcp import write_metadata

METADATA = ".metadata"


def convert_to_dcp(src: Path, dst: Path, verify: bool = True) -> Dict:
    """Write ``dst`` (a new local directory) from the committed raw checkpoint ``src`` (a folder, or
    s3://); returns counts."""
    src, dst = location(src), location(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; convert into a new directory")
    manifest = verify_checkpoint(src, checksums=verify)
    metadata = RawFileReader(src).read_metadata()
    chunks: Dict[MetadataIndex, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                chunks[MetadataIndex(fqn, c.offsets)] = (tuple(c.sizes), md.properties.dtype)
    by_file: Dict[str, List[Tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    converted, storage = 0, {}
    try:  # the commit protocol's order: data files, .metadata, the manifest last
        for name, items in sorted(by_file.items()):
            with (src / name).open("rb") as f_in, (dst / name).open("wb") as f_out:
                offset = 0
                for index, info in sorted(items, key=lambda item: item[1].offset):
                    f_in.seek(info.offset)
                    blob = f_in.read(info.length)
                    if list(info.transform_descriptors or ()) == [RAW]:
                        sizes, dtype = chunks[MetadataIndex(index.fqn, index.offset)]
                        chunk = torch.frombuffer(bytearray(blob), dtype=dtype).reshape(sizes) if blob else \
                            torch.empty(sizes, dtype=dtype)
                        buf = io.BytesIO()
                        torch.save(chunk, buf)
                        blob = buf.getvalue()
                        converted += 1
                    f_out.write(blob)  # pickled items, or chunks already in stock format, as they are
                    storage[index] = _StorageInfo(name, offset, len(blob))
                    offset += len(blob)
        others = [n for n in manifest.files if n not in by_file and n != METADATA]  # a converted folder's tokenizer
        for name in others:
            (dst / name).write_bytes((src / name).read_bytes())
        write_metadata(dst, dataclasses.replace(metadata, storage_data=storage))
        algorithm = manifest.checksum_algorithm
        files = {p.name: FileEntry(p.stat().st_size, checksum_file(p, algorithm) if algorithm else None)
                 for p in sorted(dst.iterdir()) if p.name.endswith(".distcp") or p.name in (METADATA, *others)}
        commit_checkpoint(dst, dataclasses.replace(manifest, files=files))
    except BaseException:
        dst.rmtree()  # never committed: nothing half-converted is left
        raise
    return {"chunks": converted, "files": len(by_file), "bytes": sum(e.size for e in files.values()),
            "step": manifest.step}

