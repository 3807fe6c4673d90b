"""Saving: synchronous or asynchronous DCP writes followed by the commit protocol.

sync:  the training thread writes, acknowledges and (coordinator) commits.
async: the training thread waits for the previous save, then stages a host copy
       (``dcp.async_save`` with checkpoint/staging.py) and returns; DCP writes from its
       thread and ours acknowledges and commits. At most one save is in flight.

DCP's collectives run on a dedicated gloo group: sharing the default group with training
collectives from another thread aborts or deadlocks gloo (docs/checkpoint-format.md).
Fault hooks (``fault_hook(phase, step, path)``) sit between the phases.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checkpoint.commit import acknowledge, collect_acknowledgements, commit_checkpoint, seal, update_latest
from checkpoint.integrity import checksum_file
from checkpoint.layout import committed_dir, uncommitted_dir
from checkpoint.manifest import FileEntry, Manifest
from checkpoint.staging import HostStager
from checkpoint.storage import WRITERS, RawFileWriter
from configs.constants import ASYNC_MODES

log = logging.getLogger("trainer")

FaultHook = Callable[..., None]


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@dataclass
class SaveRecord:
    step: int
    checkpoint_id: str
    mode: str
    blocking_s: float  # training thread: wait for the previous save + snapshot (+ write in sync mode)
    waited_s: float  # part of blocking_s spent waiting for the previous save
    background_s: float  # after the training thread resumed, until this rank's part was done
    bytes: int  # this checkpoint's size on disk (coordinator; 0 elsewhere)
    committed: bool  # this rank saw the commit (coordinator only)


class CheckpointSaver:
    def __init__(self, root: Path, mode: str, rank: int, world_size: int, process_group=None,
                 checksum_algorithm: Optional[str] = "xxh3_64", commit_timeout_s: float = 600.0,
                 pin_memory: bool = False, after_commit: Optional[Callable[[Manifest], None]] = None,
                 fault_hook: Optional[FaultHook] = None, storage_format: str = "raw"):
        if mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode={mode!r}: choose one of {list(ASYNC_MODES)}")
        if storage_format not in WRITERS:
            raise ValueError(f"checkpoint.format={storage_format!r}: choose one of {list(WRITERS)}")
        self.storage_format = storage_format  # raw | dcp (checkpoint/storage.py)
        self.root, self.mode, self.rank, self.world_size = Path(root), mode, rank, world_size
        self.process_group = process_group
        self.checksum_algorithm = checksum_algorithm
        self.commit_timeout_s = commit_timeout_s
        self.after_commit = after_commit  # runs on the coordinator after each commit (retention)
        self.fault_hook = fault_hook or (lambda phase, step, path=None: None)
        self.stager = HostStager(pin_memory) if mode == "async" else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-persist") if mode == "async" else None
        self._in_flight: Optional[Future] = None
        self._in_flight_step: Optional[int] = None
        self._finished: List[SaveRecord] = []

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- the training thread --------------------------------------------------------------
    def save(self, state_dict: Dict, manifest: Manifest) -> None:
        """Save ``state_dict`` as ``manifest.step``. Records of finished saves (this one in sync
        mode, the previous one in async mode) are collected with ``finished``."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        step = manifest.step
        staging = uncommitted_dir(self.root, step)
        staging.mkdir(parents=True, exist_ok=True)
        writer = WRITERS[self.storage_format](staging, self.checksum_algorithm)
        self.fault_hook("checkpoint_snapshot", step)
        if self.mode == "sync":
            dcp.save(state_dict, storage_writer=writer, process_group=self.process_group, no_dist=_no_dist())
            size, committed = self._finish(staging, manifest, writer)
            self._finished.append(SaveRecord(step, manifest.checkpoint_id, "sync", time.perf_counter() - t0,
                                             waited, 0.0, size, committed))
            return
        upload = dcp.async_save(state_dict, storage_writer=writer, process_group=self.process_group,
                                async_stager=self.stager, no_dist=_no_dist())
        blocking = time.perf_counter() - t0
        self._in_flight = self._executor.submit(self._persist, upload, writer, staging, manifest, blocking,
                                               waited)
        self._in_flight_step = step

    @property
    def in_flight(self) -> Optional[Tuple[int, Callable[[], bool]]]:
        """(step, is_done) of the background save not yet collected, or None. ``is_done`` may be
        called from any thread (the watchdog's)."""
        fut = self._in_flight
        return (self._in_flight_step, fut.done) if fut is not None else None

    def poll(self) -> None:
        """Collect the in-flight save if it is done on this rank (raises its failure)."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is done on this rank; re-raise its failure."""
        fut, self._in_flight, self._in_flight_step = self._in_flight, None, None
        if fut is not None:
            self._finished.append(fut.result())

    def finished(self) -> List[SaveRecord]:
        """Records of the saves finished since the last call."""
        out, self._finished = self._finished, []
        return out

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self.stager is not None:
                self.stager.close()

    # -- background (async) or inline (sync) ------------------------------------------------
    def _persist(self, upload: Future, writer: RawFileWriter, staging: Path, manifest: Manifest,
                 blocking: float, waited: float) -> SaveRecord:
        t0 = time.perf_counter()
        upload.result()  # DCP write done on every rank (its final gather), .metadata written
        size, committed = self._finish(staging, manifest, writer)
        return SaveRecord(manifest.step, manifest.checkpoint_id, "async", blocking, waited,
                          time.perf_counter() - t0, size, committed)

    def _finish(self, staging: Path, manifest: Manifest, writer: RawFileWriter) -> tuple:
        """Acknowledge (every rank), then collect, seal, commit and move ``latest`` (coordinator)."""
        step = manifest.step
        self.fault_hook("checkpoint_write", step, path=staging)
        acknowledge(staging, self.rank, self.checksum_algorithm, known=writer.written)
        if not self.is_coordinator:
            return 0, False
        files = collect_acknowledgements(staging, self.world_size, self.commit_timeout_s)
        meta = staging / ".metadata"
        files[".metadata"] = FileEntry(meta.stat().st_size, checksum_file(meta, self.checksum_algorithm)
                                       if self.checksum_algorithm else None)
        manifest = dataclasses.replace(manifest, files=files, checksum_algorithm=self.checksum_algorithm)
        seal(staging, manifest)
        self.fault_hook("checkpoint_commit", step, path=staging)
        final = commit_checkpoint(staging, committed_dir(self.root, step))
        update_latest(self.root, manifest.checkpoint_id)
        self.fault_hook("checkpoint_committed", step, path=final)
        if self.after_commit is not None:
            self.after_commit(manifest)
        return manifest.total_bytes, True
