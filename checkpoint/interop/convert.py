"""Convert a committed raw-format checkpoint into stock DCP's format (scripts/convert_checkpoint.py).

The saved layout is kept: every rank file becomes a rank file of the same name, every saved
chunk a chunk at the same place in DCP's metadata, so the result still reshards on load. Only
the bytes change: a raw-bytes chunk becomes a ``torch.save`` archive of that chunk (what stock
``FileSystemWriter`` writes), pickled items are copied as they are. One chunk is in memory at
a time. The output is a committed checkpoint of its own (manifest.json with the new files'
sizes and checksums), so this project resumes, exports and imports it like any other, and
``torch.distributed.checkpoint`` reads it without this project (``FileSystemReader``,
``format_utils.dcp_to_torch_save``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from checkpoint.durable.integrity import checksum_file, fsync_dir
from checkpoint.durable.location import location, open_read
from checkpoint.durable.manifest import FileEntry, verify_checkpoint, write_manifest
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.writer import RAW

METADATA = ".metadata"


def convert_to_dcp(src: Path, dst: Path, verify: bool = True) -> Dict:
    """Write ``dst`` (a new local directory) from the committed raw checkpoint ``src`` (a folder, or
    s3://); returns counts."""
    src, dst = location(src), Path(dst)
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
    tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    converted = 0
    try:
        storage = {}
        for name, items in sorted(by_file.items()):
            with open_read(src / name) as f_in, open(tmp / name, "wb") as f_out:
                for index, info in sorted(items, key=lambda item: item[1].offset):
                    f_in.seek(info.offset)
                    blob = f_in.read(info.length)
                    offset = f_out.tell()
                    if list(info.transform_descriptors or ()) == [RAW]:
                        sizes, dtype = chunks[MetadataIndex(index.fqn, index.offset)]
                        chunk = torch.frombuffer(bytearray(blob), dtype=dtype).reshape(sizes) if blob else \
                            torch.empty(sizes, dtype=dtype)
                        torch.save(chunk, f_out)
                        converted += 1
                    else:  # pickled items, or chunks already in stock format
                        f_out.write(blob)
                    storage[index] = _StorageInfo(name, offset, f_out.tell() - offset)
                f_out.flush()
                os.fsync(f_out.fileno())
        out_meta = dataclasses.replace(metadata, storage_data=storage)
        with open(tmp / METADATA, "wb") as f:
            pickle.dump(out_meta, f)
            f.flush()
            os.fsync(f.fileno())
        algorithm = manifest.checksum_algorithm
        files = {p.name: FileEntry(p.stat().st_size, checksum_file(p, algorithm) if algorithm else None)
                 for p in sorted(tmp.iterdir()) if p.name.endswith(".distcp") or p.name == METADATA}
        write_manifest(tmp, dataclasses.replace(manifest, files=files))
        fsync_dir(tmp)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"chunks": converted, "files": len(by_file), "bytes": sum(e.size for e in files.values()),
            "step": manifest.step}

