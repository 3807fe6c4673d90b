"""A memory snapshot's background half: write, replicate, commit in two rounds, drop the older steps.

On every rank, each phase agreed over the tier's group (checkpoint/memory/transport.py):
  1. write ``step_S/rankR.snap`` (checkpoint/memory/snapshot.py, checksummed as it is written);
  2. exchange with the peers: send the staged bytes (not read back from the file), receive the source
     rank's and write them to ``step_S/rankQ.snap``, checksummed as they are written;
  3. every rank holds both copies: write each copy's manifest ``rankR.json`` (the commit: a copy
     without one is ignored);
  4. every rank committed: delete the older steps.
A kill at any moment leaves the previous complete step on every node until the new one is
complete everywhere.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoint.memory.snapshot import STEP_DIR, SnapshotError, Staged, write_snapshot
from checkpoint.storage import location

log = logging.getLogger("trainer")


@dataclass
class SnapshotRecord:
    step: int
    stall_s: float  # the training thread: waiting for the previous snapshot + the host copy
    waited_s: float  # part of stall_s spent waiting for the previous snapshot
    background_s: float  # write, replica exchange, agreement, commit
    replica_s: float  # the exchange with the peers (0 without replicas)
    bytes: int  # this rank's snapshot
    replica_bytes: int  # the copy received from the source rank
    committed: bool
    transfer_s: float = 0.0  # of replica_s, the bytes on the wire (the rest: writing the replica + its checksum)

    @property
    def blocking_s(self) -> float:  # what recovery/runtime.py's AutoInterval reads, as of a durable save
        return self.stall_s


def persist(tier, step: int, staged: Staged, info: dict, stall: float, waited: float) -> SnapshotRecord:
    """Write, exchange, commit; each phase agreed over the group, so a rank that failed (a full
    tmpfs) never leaves its peer waiting in a transfer that will not come."""
    t0 = time.perf_counter()
    d = tier.dir / STEP_DIR.format(step)
    replica_bytes, replica_s, transfer_s, replica_info, size = 0, 0.0, 0.0, None, 0

    def failed() -> SnapshotRecord:
        return SnapshotRecord(step, stall, waited, time.perf_counter() - t0, replica_s, size, replica_bytes, False)

    try:
        d.mkdir(parents=True, exist_ok=True)
        for owner in {tier.rank, tier.peers.source if tier.peers.source is not None else tier.rank}:
            (d / f"rank{owner:05d}.json").unlink(missing_ok=True)  # a commit of an earlier try of this step
        own = d / f"rank{tier.rank:05d}.snap"
        size, checksum = write_snapshot(own, staged, tier.algorithm)
        info.update(size=size, checksum=checksum)
        ok = True
    except Exception as exc:
        log.error("memory snapshot of step %d: writing on rank %d failed: %s: %s", step, tier.rank,
                  type(exc).__name__, exc)
        ok = False
    if not tier.peers.all_ok(ok):
        return failed()
    if tier.peers.peer is not None:
        t1 = time.perf_counter()
        try:
            replica_info = tier.peers.exchange(staged, info, d)
            replica_bytes, ok = replica_info["size"], True
        except SnapshotError as exc:  # the transfer itself completed on both sides
            log.error("memory snapshot of step %d on rank %d: %s", step, tier.rank, exc)
            ok = False
        replica_s, transfer_s = time.perf_counter() - t1, tier.peers.transfer_s
        if not tier.peers.all_ok(ok):
            return failed()
    location(d / f"rank{tier.rank:05d}.json").write_text(json.dumps(info))
    if replica_info is not None:
        location(d / f"rank{replica_info['owner']:05d}.json").write_text(json.dumps(replica_info))
    if tier.peers.all_ok(True):  # every rank committed step: the older ones can go
        drop_older(tier.dir, step)
    return SnapshotRecord(step, stall, waited, time.perf_counter() - t0, replica_s, size, replica_bytes, True,
                          transfer_s)


def drop_older(directory: Path, step: int) -> None:
    """Delete the steps before ``step`` (every rank has committed ``step``)."""
    for d in directory.glob("step_*"):
        try:
            if int(d.name.split("_")[1]) < step:
                shutil.rmtree(d, ignore_errors=True)
        except ValueError:
            continue
