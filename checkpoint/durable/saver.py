"""Saving: synchronous or asynchronous DCP writes followed by the commit protocol.

sync:  the training thread writes, acknowledges and (coordinator) commits.
async: the training thread waits for the previous save, then stages a host copy
       (``dcp.async_save`` with checkpoint/state/staging.py) and returns; DCP writes from its
       thread and ours acknowledges and commits. At most one save is in flight.
async_process: as async, but DCP plans and writes in a writer process of each rank (DCP's
       ``AsyncCheckpointerType.PROCESS``, started at the first save and kept), so the planning
       of a large state (about 40 s on the coordinator at 70B on 512 ranks, the first save) and
       the writing never hold the training process's GIL. The writer's checksums stay in that
       process, so the acknowledgement reads each file back to checksum it.

DCP's collectives run on a dedicated gloo group: sharing the default group with training
collectives from another thread aborts or deadlocks gloo (docs/checkpoint-format.md).
Fault hooks (``fault_hook(phase, step, path)``) sit between the phases.

A failure in a phase is agreed on that group (DCP agrees on its own), so every rank ends the
same save the same way. When the storage refused it (disk full, read-only, over quota) the
coordinator removes the uncommitted directory and every rank raises ``CheckpointSaveError``
(checkpoint/durable/save_errors.py); the manager decides whether the run stops. ``attempt`` is this
attempt's lease (checkpoint/durable/lease.py): checked before acknowledging and before committing.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint.config import ASYNC_MODES
from checkpoint.durable.commit import acknowledge, collect_acknowledgements, commit_checkpoint, update_latest
from checkpoint.durable.discovery import fresh_dir
from checkpoint.durable.lease import StaleWriter, check_lease, newer_owner
from checkpoint.durable.manifest import FileEntry, Manifest, checksum_file
from checkpoint.durable.raw import RawFileWriter  # unit: raw
from checkpoint.durable.save_errors import RankFailures, failures_of, outcome_of, refused_save, storage_errno
from checkpoint.durable.writer import StockFileWriter, _StoreWriter
from checkpoint.state.staging import HostStager
from checkpoint.storage import Loc, location
from parallel import collectives

WRITERS = {"dcp": StockFileWriter}  # checkpoint.format -> the writer of its data files
WRITERS["raw"] = RawFileWriter  # unit: raw

log = logging.getLogger("trainer")

FaultHook = Callable[..., None]


def _planner() -> DefaultSavePlanner:
    """DCP's planner with plan caching: a save whose state has the structure of the previous one
    (every save of a run, but the first and after a change of layout) sends an empty plan, and the
    coordinator reuses the global plan and metadata instead of planning every item again
    (scripts/bench_dcp_planning.py measures it at 70B on 512 ranks)."""
    return DefaultSavePlanner(enable_plan_caching=True)


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
        self.storage_format = storage_format  # raw | dcp (checkpoint/durable/writer.py)
        self.root, self.mode, self.rank, self.world_size = location(root), mode, rank, world_size
        self.process_group = process_group
        self.checksum_algorithm = checksum_algorithm
        self.commit_timeout_s = commit_timeout_s
        self.after_commit = after_commit  # runs on the coordinator after each commit (retention)
        self.fault_hook = fault_hook or (lambda phase, step, path=None: None)
        background = mode != "sync"
        self.stager = HostStager(pin_memory) if background else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-persist") if background else None
        self._in_flight: Optional[Future] = None
        self._in_flight_step: Optional[int] = None
        self._finished: List[SaveRecord] = []
        self.attempt: Optional[int] = None  # the lease (checkpoint/durable/lease.py) the manager took; None: unchecked
        self.expected_bytes: Optional[int] = None  # one checkpoint's size, for the messages of failed saves

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- the training thread --------------------------------------------------------------
    def save(self, state_dict: Dict, manifest: Manifest, started: Optional[float] = None) -> None:
        """Save ``state_dict`` as ``manifest.step``. Records of finished saves (this one in sync
        mode, the previous one in async mode) are collected with ``finished``. ``started``: when
        the save began on the training thread (before its manifest's probe), for its blocking time."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        t0 = t0 if started is None else started
        step = manifest.step
        try:
            staging = self._folder(step)
        except BaseException as exc:
            raise self._failed(exc, step, None)  # nothing written yet
        manifest = dataclasses.replace(manifest, checkpoint_id=staging.name)
        writer = WRITERS[self.storage_format](staging, self.checksum_algorithm)
        self.fault_hook("checkpoint_snapshot", step)
        if self.mode == "sync":
            try:
                dcp.save(state_dict, storage_writer=writer, process_group=self.process_group, no_dist=_no_dist(),
                         planner=_planner())
                size, committed = self._finish(staging, manifest, writer)
            except BaseException as exc:
                raise self._failed(exc, step, staging)
            self._finished.append(SaveRecord(step, manifest.checkpoint_id, "sync", time.perf_counter() - t0,
                                             waited, 0.0, size, committed))
            return
        try:
            kind = AsyncCheckpointerType.PROCESS if self.mode == "async_process" else AsyncCheckpointerType.THREAD
            upload = dcp.async_save(state_dict, storage_writer=writer, process_group=self.process_group,
                                    planner=_planner(), async_stager=self.stager, no_dist=_no_dist(),
                                    async_checkpointer_type=kind)
        except BaseException as exc:
            raise self._failed(exc, step, staging)
        blocking = time.perf_counter() - t0
        self._in_flight = self._executor.submit(self._persist, upload, writer, staging, manifest, blocking,
                                               waited)
        self._in_flight_step = step

    def _folder(self, step: int) -> Loc:
        """The fresh folder of this save (checkpoint/durable/discovery.py), chosen by the coordinator and given
        to every rank: a save of a step that exists goes beside it, never into it."""
        chosen: List[str] = []
        self._agreed("choosing the checkpoint's folder",
                     lambda: chosen.append(fresh_dir(self.root, step).name) if self.is_coordinator else None)
        name = chosen[0] if chosen else None
        if not (_no_dist() or self.world_size == 1):
            name = collectives.broadcast_object(name, group=self.process_group)
        return self.root / name

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
    def _persist(self, upload: Future, writer: _StoreWriter, staging: Loc, manifest: Manifest,
                 blocking: float, waited: float) -> SaveRecord:
        t0 = time.perf_counter()
        try:
            upload.result()  # DCP write done on every rank (its final gather), .metadata written
            size, committed = self._finish(staging, manifest, writer)
        except BaseException as exc:
            raise self._failed(exc, manifest.step, staging)
        return SaveRecord(manifest.step, manifest.checkpoint_id, self.mode, blocking, waited,
                          time.perf_counter() - t0, size, committed)

    def _finish(self, staging: Loc, manifest: Manifest, writer: _StoreWriter) -> tuple:
        """Acknowledge (every rank), then collect, commit and move ``latest`` (coordinator).
        Each of the two phases ends with an agreement, so all ranks succeed or fail it together."""
        step = manifest.step

        def ack() -> None:
            self.fault_hook("checkpoint_write", step, path=staging)
            check_lease(self.root, self.attempt)
            acknowledge(staging, self.rank, self.checksum_algorithm, known=writer.written, attempt=self.attempt)

        self._agreed("acknowledging the checkpoint files", ack)
        committed: List[Manifest] = []
        self._agreed("committing the checkpoint",
                     lambda: committed.append(self._commit(staging, manifest)) if self.is_coordinator else None)
        if not committed:
            return 0, False
        manifest = committed[0]
        self.fault_hook("checkpoint_committed", step, path=staging)
        if self.after_commit is not None:
            self.after_commit(manifest)
        return manifest.total_bytes, True

    def _commit(self, staging: Loc, manifest: Manifest) -> Manifest:
        """Coordinator: collect the acknowledgements, create the manifest (the commit), move ``latest``."""
        step = manifest.step
        files = collect_acknowledgements(staging, self.world_size, self.commit_timeout_s, attempt=self.attempt)
        meta = staging / ".metadata"
        files[".metadata"] = FileEntry(meta.stat().st_size, checksum_file(meta, self.checksum_algorithm)
                                       if self.checksum_algorithm else None)
        manifest = dataclasses.replace(manifest, files=files, checksum_algorithm=self.checksum_algorithm)
        self.fault_hook("checkpoint_commit", step, path=staging)
        check_lease(self.root, self.attempt)  # the last look before the commit
        commit_checkpoint(staging, manifest)
        try:
            check_lease(self.root, self.attempt)  # a newer attempt that started meanwhile keeps `latest`
            update_latest(self.root, manifest.checkpoint_id)
        except OSError as exc:  # committed all the same: discovery scans the directory, `latest` is for people
            log.warning("%s committed, but the latest pointer was not updated: %s", manifest.checkpoint_id, exc)
        return manifest

    def _agreed(self, phase: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this rank, then agree on the outcome over the checkpoint group: if it
        failed on any rank, every rank raises RankFailures (this rank's own error as its cause)."""
        error: Optional[BaseException] = None
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - agreed, then raised again on every rank
            error = exc
        if _no_dist() or self.world_size == 1:
            if error is not None:
                raise error
            return
        failures = failures_of(collectives.all_gather_object(outcome_of(error), self.process_group))
        if failures:
            raise RankFailures(phase, failures) from error

    def _failed(self, exc: BaseException, step: int, staging: Optional[Loc]) -> BaseException:
        """What a failed save raises. A newer attempt owns the directory: StaleWriter, whatever the failure (its
        start-up clean-up may have removed this save's files: ENOENT), and nothing is touched. A storage failure
        (every rank knows by now): the coordinator removes the uncommitted directory; CheckpointSaveError with
        the numbers. Anything else (a bug, an injected exception) is raised as it is."""
        if not isinstance(exc, StaleWriter):
            stale = self._newer_attempt(exc)
            if stale is not None:
                stale.__cause__ = exc
                return stale
        code = storage_errno(exc)
        if code is None:
            return exc
        return refused_save(exc, code, step, self.root, staging, self.rank, self.expected_bytes, self.is_coordinator)

    def _newer_attempt(self, exc: BaseException) -> Optional[StaleWriter]:
        """StaleWriter if a newer attempt owns the directory; a failure every rank met (an agreed phase,
        DCP's gathered errors) is judged once, by the coordinator (lease.newer_owner)."""
        every_rank = isinstance(exc, (RankFailures, CheckpointException)) and not _no_dist() and self.world_size > 1
        return newer_owner(self.root, self.attempt, self.is_coordinator if every_rank else None, self.process_group)
