"""The commit protocol (contract 3), as separate phases so faults can be injected between them.

1. every rank writes its files into ``step_N.uncommitted/`` (DCP, fsync per file);
2. every rank records its files' sizes and checksums (computed by the writer as it wrote them,
   checkpoint/durable/writer.py) in an acknowledgement ``acks/rank_R.json``;
3. the coordinator waits for all acknowledgements (with a timeout: a failed or late rank
   leaves the checkpoint uncommitted and the previous one current), writes the manifest
   and fsyncs files and directory;
4. ``commit_checkpoint``: atomic rename to ``step_N/`` plus fsync of the parent;
5. ``update_latest``: the ``latest`` pointer is replaced atomically.

A crash before 4 leaves only an ``.uncommitted`` directory, which discovery ignores.

On an object store (``checkpoint.dir=s3://...``) there is no rename. Every object is written
under its final name ``step_N/``, and the commit is phase 3b's manifest, written last and only
if it does not exist yet (a PUT with ``If-None-Match: *``): a ``step_N/`` without a manifest is
an interrupted save, never loaded and removed at start-up with any multipart upload left open.
An older save of the same step is moved aside before the new one is written (``make_room``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

from checkpoint.durable.integrity import atomic_write_text, checksum_files, fsync_dir, fsync_file
from checkpoint.durable.layout import ACKS, LATEST, MANIFEST, REPLACED
from checkpoint.durable.location import create_exclusive, location, move_tree, on_object_store, remove_tree
from checkpoint.durable.manifest import CheckpointError, FileEntry, Manifest, write_manifest


class CommitTimeout(CheckpointError):
    """Not every rank acknowledged its files in time: the checkpoint stays uncommitted."""


def rank_files(directory: Path, rank: int) -> List[Path]:
    """The data files rank ``rank`` wrote: DCP's FileSystemWriter names them ``__<rank>_<n>.distcp``."""
    return sorted(location(directory).glob(f"__{rank}_*.distcp"))


def acknowledge(directory: Path, rank: int, algorithm: str | None,
                known: Optional[Dict[str, FileEntry]] = None, attempt: Optional[int] = None) -> Dict[str, FileEntry]:
    """Phase 2: record this rank's files durably in ``acks/rank_R.json``. Checksums come from
    ``known`` (what the writer hashed while writing; a file whose size has changed since is
    refused); files the writer did not report are read back and checksummed here. ``attempt``
    (checkpoint/durable/lease.py) is recorded, so the coordinator never counts another attempt's ack."""
    files = rank_files(directory, rank)
    known = known or {}
    entries: Dict[str, FileEntry] = {}
    for p in files:
        size, k = p.stat().st_size, known.get(p.name)
        if k is not None and k.size != size:
            raise CheckpointError(f"{p}: {size} bytes on disk after its writer wrote and fsynced {k.size}; "
                                  "not acknowledged, the checkpoint stays uncommitted")
        if k is not None and (k.checksum is not None or not algorithm):
            entries[p.name] = FileEntry(size=size, checksum=k.checksum)
    rest = [p for p in files if p.name not in entries]
    sums = checksum_files(rest, algorithm) if algorithm else {}
    entries.update({p.name: FileEntry(size=p.stat().st_size, checksum=sums.get(p.name)) for p in rest})
    ack_dir = location(directory) / ACKS
    ack_dir.mkdir(exist_ok=True)
    payload = {"rank": rank, "attempt": attempt, "files": {k: vars(v) for k, v in entries.items()}}
    atomic_write_text(ack_dir / f"rank_{rank:05d}.json", json.dumps(payload))
    return entries


def collect_acknowledgements(directory: Path, world_size: int, timeout_s: float,
                             poll_s: float = 0.05, attempt: Optional[int] = None) -> Dict[str, FileEntry]:
    """Phase 3a (coordinator): wait for every rank's acknowledgement; their files, merged. With
    ``attempt``, an acknowledgement written by another attempt's rank is refused."""
    ack_dir = location(directory) / ACKS
    poll_s = max(poll_s, 0.5) if on_object_store(directory) else poll_s  # a listing is a request there
    deadline = time.monotonic() + timeout_s
    while True:
        present = {p.name for p in ack_dir.glob("rank_*.json")} if ack_dir.is_dir() else set()
        missing = [r for r in range(world_size) if f"rank_{r:05d}.json" not in present]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CommitTimeout(f"{directory}: ranks {missing[:16]} did not acknowledge their files within "
                                f"{timeout_s:.0f} s (checkpoint.commit_timeout_s); left uncommitted")
        time.sleep(poll_s)
    files: Dict[str, FileEntry] = {}
    for r in range(world_size):
        payload = json.loads((ack_dir / f"rank_{r:05d}.json").read_text())
        if attempt is not None and payload.get("attempt") != attempt:
            raise CheckpointError(f"{directory}: the acknowledgement of rank {r} was written by attempt "
                                  f"{payload.get('attempt')}, this is attempt {attempt}: two attempts are writing "
                                  "this checkpoint; left uncommitted")
        files.update({k: FileEntry(**v) for k, v in payload["files"].items()})
    return files


def seal(directory: Path, manifest: Manifest) -> None:
    """Phase 3b (coordinator): check every DCP file is acknowledged, write the manifest, fsync."""
    directory = location(directory)
    on_disk = {p.name for p in directory.glob("*.distcp")}
    unacked = sorted(on_disk - set(manifest.files))
    if unacked:
        raise CheckpointError(f"{directory}: files without an acknowledgement: {unacked[:8]}")
    for name in manifest.files:
        if name.endswith(".distcp"):
            continue
        fsync_file(directory / name)  # .metadata; data files were fsynced by their writers
    if not on_object_store(directory):  # there, writing the manifest is the commit itself
        write_manifest(directory, manifest)
        fsync_dir(directory)


def make_room(final: Path) -> None:
    """On an object store, before a save of this step writes anything (coordinator): an older
    committed save of the same step (a re-save after resuming from an earlier one) is moved aside,
    never deleted; the objects of an interrupted save there are deleted."""
    final = location(final)
    if not on_object_store(final) or not final.is_dir():
        return
    if (final / MANIFEST).is_file():
        move_tree(final, final.with_name(f"{final.name}{REPLACED}{time.time_ns()}"))
    else:
        remove_tree(final)


def commit_checkpoint(uncommitted: Path, final: Path, manifest: Optional[Manifest] = None) -> Path:
    """Phase 4: the atomic rename that makes the checkpoint visible, then fsync of the parent.
    On an object store: the manifest (``manifest``) is written, only if none exists.

    An older checkpoint of the same step (a re-save after resuming from an earlier one) is
    moved aside first, never deleted here.
    """
    uncommitted, final = location(uncommitted), location(final)
    if on_object_store(final):
        if manifest is None:
            raise CheckpointError(f"{final}: refusing to commit without a manifest")
        try:
            create_exclusive(final / MANIFEST, manifest.to_json().encode())
        except FileExistsError as exc:
            raise CheckpointError(f"{final}: a manifest exists already (another writer committed this step); "
                                  "this save is left uncommitted") from exc
        return final
    if not (uncommitted / MANIFEST).is_file():
        raise CheckpointError(f"{uncommitted}: refusing to commit without a manifest")
    if final.exists():
        os.rename(final, final.with_name(f"{final.name}{REPLACED}{time.time_ns()}"))  # unique, even twice a second
    os.rename(uncommitted, final)
    fsync_dir(final.parent)
    return final


def update_latest(root: Path, checkpoint_id: str) -> None:
    """Phase 5: move the ``latest`` pointer (atomic replace + fsync)."""
    atomic_write_text(location(root) / LATEST, checkpoint_id + "\n")
