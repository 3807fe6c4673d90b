"""The commit protocol (contract 3, docs/checkpoint-format.md), as separate phases so faults can be injected
between them: every rank acknowledges the files it wrote into the save's fresh folder; the coordinator
collects the acknowledgements and creates ``manifest.json`` only if absent (the commit: from that instant
the checkpoint is committed, and a second writer of the folder is refused), then moves ``latest``. A crash
before the commit leaves a folder without a manifest, which discovery ignores and the next start removes.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

from checkpoint.durable.discovery import LATEST
from checkpoint.durable.manifest import MANIFEST, CheckpointError, FileEntry, Manifest, checksum_files
from checkpoint.storage import Loc, location

ACKS = "acks"  # inside a checkpoint being saved: one file per rank that finished writing
POLL_S, POLL_MAX_S = 0.05, 1.0  # the coordinator's look for acknowledgements, backing off (a listing is a request)


class CommitTimeout(CheckpointError):
    """Not every rank acknowledged its files in time: the checkpoint stays uncommitted."""


def rank_files(directory, rank: int) -> List[Loc]:
    """The data files rank ``rank`` wrote: DCP's FileSystemWriter names them ``__<rank>_<n>.distcp``."""
    return sorted(location(directory).glob(f"__{rank}_*.distcp"))


def acknowledge(directory, rank: int, algorithm: str | None,
                known: Optional[Dict[str, FileEntry]] = None, attempt: Optional[int] = None) -> Dict[str, FileEntry]:
    """Record this rank's files durably in ``acks/rank_R.json``. Checksums come from
    ``known`` (what the writer hashed while writing; a file whose size has changed since is
    refused); files the writer did not report are read back and checksummed here. ``attempt``
    (checkpoint/durable/lease.py) is recorded, so the coordinator never counts another attempt's ack."""
    files = rank_files(directory, rank)
    known = known or {}
    entries: Dict[str, FileEntry] = {}
    for p in files:
        size, k = p.stat().st_size, known.get(p.name)
        if k is not None and k.size != size:
            raise CheckpointError(f"{p}: {size} bytes in storage after its writer wrote {k.size}; "
                                  "not acknowledged, the checkpoint stays uncommitted")
        if k is not None and (k.checksum is not None or not algorithm):
            entries[p.name] = FileEntry(size=size, checksum=k.checksum)
    rest = [p for p in files if p.name not in entries]
    sums = checksum_files(rest, algorithm) if algorithm else {}
    entries.update({p.name: FileEntry(size=p.stat().st_size, checksum=sums.get(p.name)) for p in rest})
    payload = {"rank": rank, "attempt": attempt, "files": {k: vars(v) for k, v in entries.items()}}
    (location(directory) / ACKS / f"rank_{rank:05d}.json").write_text(json.dumps(payload))
    return entries


def collect_acknowledgements(directory, world_size: int, timeout_s: float,
                             attempt: Optional[int] = None) -> Dict[str, FileEntry]:
    """The coordinator: wait for every rank's acknowledgement; their files, merged. With
    ``attempt``, an acknowledgement written by another attempt's rank is refused."""
    ack_dir = location(directory) / ACKS
    deadline, poll = time.monotonic() + timeout_s, POLL_S
    while True:
        present = {e.name for e in ack_dir.entries()}
        missing = [r for r in range(world_size) if f"rank_{r:05d}.json" not in present]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CommitTimeout(f"{directory}: ranks {missing[:16]} did not acknowledge their files within "
                                f"{timeout_s:.0f} s (checkpoint.commit_timeout_s); left uncommitted")
        time.sleep(poll)
        poll = min(2 * poll, POLL_MAX_S)
    files: Dict[str, FileEntry] = {}
    for r in range(world_size):
        payload = json.loads((ack_dir / f"rank_{r:05d}.json").read_text())
        if attempt is not None and payload.get("attempt") != attempt:
            raise CheckpointError(f"{directory}: the acknowledgement of rank {r} was written by attempt "
                                  f"{payload.get('attempt')}, this is attempt {attempt}: two attempts are writing "
                                  "this checkpoint; left uncommitted")
        files.update({k: FileEntry(**v) for k, v in payload["files"].items()})
    unacked = sorted(e.name for e in location(directory).entries() if e.name.endswith(".distcp")
                     and e.name not in files)
    if unacked:
        raise CheckpointError(f"{directory}: files without an acknowledgement: {unacked[:8]}")
    return files


def commit_checkpoint(directory, manifest: Manifest) -> Loc:
    """The commit: create the manifest, only if none exists; from then on the checkpoint is committed."""
    directory = location(directory)
    try:
        (directory / MANIFEST).create_bytes(manifest.to_json().encode())
    except FileExistsError as exc:
        raise CheckpointError(f"{directory}: a manifest exists already (another writer committed this folder); "
                              "this save is left uncommitted") from exc
    return directory


def update_latest(root, checkpoint_id: str) -> None:
    """Move the ``latest`` pointer (an atomic replace)."""
    (location(root) / LATEST).write_text(checkpoint_id + "\n")
