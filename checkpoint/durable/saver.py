"""A durable save: DCP writes the data files, then the commit protocol (docs/checkpoint-format.md, "Saving
and the commit protocol": the modes, the phases and why DCP has a gloo group of its own).

In sync mode the training thread does it all; in async modes it waits for the previous save, stages a host
copy (HostStager, checkpoint/durable/staging.py) and returns, and the rest runs on the saver's thread (DCP
writes from its own thread, or from a writer process of each rank with ``async_process``). The commit
protocol's phases (acknowledge, collect, create the manifest only if absent, move ``latest``) are separate
functions, with fault hooks between them, and each phase's outcome is agreed on the checkpoint group, so
every rank ends a save the same way. A save the storage refused (disk full, read-only, over quota): the
coordinator removes the uncommitted folder and every rank raises ``CheckpointSaveError`` with the numbers and
what to do; committed checkpoints are never touched. ``attempt`` is this attempt's lease
(checkpoint/durable/lease.py), checked before acknowledging and before committing.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint.config import ASYNC_MODES
from checkpoint.durable.discovery import LATEST, fresh_dir, latest_committed, remove_checkpoint
from checkpoint.durable.lease import StaleWriter, check_lease, newer_owner
from checkpoint.durable.manifest import MANIFEST, CheckpointError, FileEntry, Manifest, checksum_file, checksum_files
from checkpoint.durable.raw import RawFileWriter  # unit: raw
from checkpoint.durable.staging import HostStager
from checkpoint.durable.writer import StockFileWriter, _StoreWriter
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
    return not collectives.distributed()


# -- the commit protocol -----------------------------------------------------------------------------
ACKS = "acks"  # inside a checkpoint being saved: one file per rank that finished writing
POLL_S, POLL_MAX_S = 0.05, 1.0  # the coordinator's look for acknowledgements, backing off (a listing is a request)


class CommitTimeout(CheckpointError):
    """Not every rank acknowledged its files in time: the checkpoint stays uncommitted."""


def acknowledge(directory, rank: int, algorithm: str | None,
                known: Optional[Dict[str, FileEntry]] = None, attempt: Optional[int] = None) -> Dict[str, FileEntry]:
    """Record this rank's files durably in ``acks/rank_R.json``. Checksums come from
    ``known`` (what the writer hashed while writing; a file whose size has changed since is
    refused); files the writer did not report are read back and checksummed here. ``attempt``
    (checkpoint/durable/lease.py) is recorded, so the coordinator never counts another attempt's ack."""
    files = sorted(location(directory).glob(f"__{rank}_*.distcp"))  # DCP's names of this rank's files
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


# -- a failed save -----------------------------------------------------------------------------------
# errno -> what the storage said, and the first thing to do about it
_REASONS = {
    errno.ENOSPC: ("the disk is full (ENOSPC)", "free space there or point checkpoint.dir at a larger volume"),
    errno.EDQUOT: ("the disk quota is exhausted (EDQUOT)",
                   "free space in your quota, raise the quota, or point checkpoint.dir elsewhere"),
    errno.EROFS: ("the file system is read-only (EROFS)",
                  "remount it read-write or point checkpoint.dir at a writable volume"),
    errno.EACCES: ("permission denied (EACCES)", "make the directory writable by this user"),
    errno.EPERM: ("operation not permitted (EPERM)", "make the directory writable by this user"),
}
STORAGE_ERRNOS = frozenset(_REASONS) | {errno.EIO, errno.EFBIG, errno.ESTALE}


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written or committed because of the storage; nothing committed
    was lost. ``errno`` is the storage's error number (the first rank's), ``step`` the save's."""

    def __init__(self, message: str, step: int, errno_: Optional[int]):
        super().__init__(message)
        self.step, self.errno = step, errno_


class RankFailures(CheckpointError):
    """A phase of a save failed on some ranks; every rank raises this, with each rank's failure
    (``failures``: {rank: exception}; storage errors are OSErrors with their errno)."""

    def __init__(self, phase: str, failures: Dict[int, BaseException]):
        super().__init__(f"{phase} failed on rank(s) {sorted(failures)}: "
                         + "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items())))
        self.failures = failures


def outcome_of(error: Optional[BaseException]) -> Optional[tuple]:
    """This rank's failure of a save phase as a picklable tuple to gather (None: it succeeded); a storage
    error keeps its errno, so every rank can judge it as storage_errno does."""
    if isinstance(error, OSError) and error.errno is not None:
        return ("os", error.errno, error.strerror, error.filename)
    return None if error is None else ("other", type(error).__name__, str(error), None)


def failures_of(outcomes: List[Optional[tuple]]) -> Dict[int, BaseException]:
    """{rank: its failure} from the gathered ``outcome_of`` tuples."""
    return {r: OSError(a, b, filename) if what == "os" else CheckpointError(f"{a}: {b}")
            for r, (what, a, b, filename) in ((r, o) for r, o in enumerate(outcomes) if o is not None)}


def rank_errors(exc: BaseException, rank: int) -> List[Tuple[int, BaseException]]:
    """(rank, error) for each failure behind ``exc``: the per-rank failures of a DCP
    ``CheckpointException`` or of ``RankFailures`` ({rank: exception or (exception,
    traceback)}), else ``exc`` itself as ``rank``'s."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return sorted(((r, f[0] if isinstance(f, tuple) else f) for r, f in failures.items()),
                      key=lambda x: x[0])
    return [(rank, exc)]


def storage_errno(exc: BaseException) -> Optional[int]:
    """The errno of the first storage failure behind ``exc`` (itself, its cause, per-rank
    failures), or None when the save failed for another reason (a bug, a dead peer, an injected
    exception), which then stays what it is."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
        todo += [err for _, err in rank_errors(e, -1) if err is not e] + [e.__cause__, e.__context__]
    return None


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n:,} bytes ({n / 2**20:.1f} MiB)"


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
        self.stager = HostStager(pin_memory, share_memory=mode == "async_process") if background else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-persist") if background else None
        self._in_flight: Optional[Future] = None
        self._in_flight_step: Optional[int] = None
        self._finished: List[SaveRecord] = []
        self.attempt: Optional[int] = None  # the lease (checkpoint/durable/lease.py) the manager took; None: unchecked
        self.lease_root = root  # where that lease lives: root, or a replica group's (lease.group_lease)
        self.expected_bytes: Optional[int] = None  # one checkpoint's size, for the messages of failed saves

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- the training thread --------------------------------------------------------------
    def save(self, state_dict: Dict, manifest: Manifest, started: Optional[float] = None,
             probe_loss: Optional[Future] = None) -> None:
        """Save ``state_dict`` as ``manifest.step``. Records of finished saves (this one in sync
        mode, the previous one in async mode) are collected with ``finished``. ``started``: when
        the save began on the training thread (before its manifest's probe), for its blocking time.
        ``probe_loss`` (async modes): the manifest's probe loss, known later (the next step's); the
        coordinator's commit waits for it (recovery/probe.py NEXT_MICRO_BATCH)."""
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
            assert probe_loss is None, "a sync save commits before the next step"
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
                                               waited, probe_loss)
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
                 blocking: float, waited: float, probe_loss: Optional[Future] = None) -> SaveRecord:
        t0 = time.perf_counter()
        try:
            upload.result()  # DCP write done on every rank (its final gather), .metadata written
            size, committed = self._finish(staging, manifest, writer, probe_loss)
        except BaseException as exc:
            raise self._failed(exc, manifest.step, staging)
        return SaveRecord(manifest.step, manifest.checkpoint_id, self.mode, blocking, waited,
                          time.perf_counter() - t0, size, committed)

    def _finish(self, staging: Loc, manifest: Manifest, writer: _StoreWriter,
                probe_loss: Optional[Future] = None) -> tuple:
        """Acknowledge (every rank), then collect, commit and move ``latest`` (coordinator).
        Each of the two phases ends with an agreement, so all ranks succeed or fail it together."""
        step = manifest.step

        def ack() -> None:
            self.fault_hook("checkpoint_write", step, path=staging)
            check_lease(self.lease_root, self.attempt)
            acknowledge(staging, self.rank, self.checksum_algorithm, known=writer.written, attempt=self.attempt)

        self._agreed("acknowledging the checkpoint files", ack)
        committed: List[Manifest] = []
        self._agreed("committing the checkpoint",
                     lambda: committed.append(self._commit(staging, manifest, probe_loss))
                     if self.is_coordinator else None)
        if not committed:
            return 0, False
        manifest = committed[0]
        self.fault_hook("checkpoint_committed", step, path=staging)
        if self.after_commit is not None:
            self.after_commit(manifest)
        return manifest.total_bytes, True

    def _commit(self, staging: Loc, manifest: Manifest, probe_loss: Optional[Future] = None) -> Manifest:
        """Coordinator: collect the acknowledgements, create the manifest (the commit), move ``latest``. A
        ``probe_loss`` still to come is waited for: no manifest without its probe (cancelled: uncommitted)."""
        step = manifest.step
        files = collect_acknowledgements(staging, self.world_size, self.commit_timeout_s, attempt=self.attempt)
        if probe_loss is not None:
            manifest = dataclasses.replace(manifest, probe_loss=float(probe_loss.result()))
        meta = staging / ".metadata"
        files[".metadata"] = FileEntry(meta.stat().st_size, checksum_file(meta, self.checksum_algorithm)
                                       if self.checksum_algorithm else None)
        manifest = dataclasses.replace(manifest, files=files, checksum_algorithm=self.checksum_algorithm)
        self.fault_hook("checkpoint_commit", step, path=staging)
        check_lease(self.lease_root, self.attempt)  # the last look before the commit
        commit_checkpoint(staging, manifest)
        try:
            check_lease(self.lease_root, self.attempt)  # a newer attempt that started meanwhile keeps `latest`
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
        """What a failed save raises: StaleWriter when a newer attempt owns the directory, whatever the failure
        (its start-up clean-up may have removed this save's files), and nothing is touched; a storage failure's
        CheckpointSaveError (``_refused``); anything else (a bug, an injected exception) as it is."""
        if isinstance(exc, StaleWriter):
            return exc
        newer, kept = self._judged(exc)
        if newer is not None:
            stale = StaleWriter(newer)
            stale.__cause__ = exc
            return stale
        code = storage_errno(exc)
        if code is None:
            return exc
        return self._refused(exc, code, step, staging, kept)

    def _refused(self, exc: BaseException, code: int, step: int, staging: Optional[Loc],
                 kept: str) -> CheckpointSaveError:
        """The CheckpointSaveError of a save the storage refused (``code``, from ``exc``), on every rank: the
        coordinator removes the uncommitted folder (after the judgement, so no rank waits for it); ``kept``
        says what is committed (``_judged``). The message: which save, where, why (per rank), free bytes, one
        checkpoint's size, what to do."""
        removed = None  # the coordinator's job
        if staging is None:  # failed before a folder was chosen: nothing to remove
            removed, staging = "never", self.root
        elif self.is_coordinator:
            try:
                remove_checkpoint(staging)
                removed = True
            except FileNotFoundError:  # never created
                removed = True
            except OSError:
                removed = False  # removed at the next start
        try:
            free: Optional[int] = self.root.free_bytes()
        except OSError:
            free = None
        reason, fix = _REASONS.get(code, ("the storage refused the write", "check the file system"))
        if code not in _REASONS and self.root.failure_hint() is not None:
            reason, fix = self.root.failure_hint()
        errors = [f"rank {r}: {e}" for r, e in rank_errors(exc, self.rank)]
        detail = "; ".join(errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
        gone = {True: "removed", None: "removed by rank 0, or at the next start",
                False: "not removed, the storage did not answer: the next start removes it",
                "never": "none made: the storage failed before the save chose its folder"}[removed]
        err = CheckpointSaveError(
            f"checkpoint of step {step} could not be saved: {reason}. {detail}.\n"
            f"  directory: {staging} ({gone}; nothing committed was touched: {kept})\n"
            f"  free in {self.root}: {_bytes(free)}; one checkpoint of this run: {_bytes(self.expected_bytes)}; "
            "while a save is written the directory holds checkpoint.keep_last + 1 of them\n"
            f"  what to do: {fix}, or lower checkpoint.keep_last; then relaunch: the run resumes from the newest "
            "committed checkpoint. checkpoint.on_save_error=continue trains on when a save fails (an alarm in "
            "metrics.jsonl; the next interval tries again).", step, code)
        err.__cause__ = exc
        return err

    def _judged(self, exc: BaseException) -> Tuple[Optional[str], Optional[str]]:
        """(the StaleWriter message if a newer attempt owns the directory, the committed checkpoints in words for
        a storage failure's message). A failure every rank met (an agreed phase, DCP's gathered errors) is judged
        once, by the coordinator, and every rank takes its answer: ranks judging alone could end the same failed
        save differently (StaleWriter here, a CheckpointSaveError that on_save_error=continue trains past there)
        and then wait in different collectives; and 512 ranks would list the directory and read every manifest
        only to word one message."""
        every_rank = isinstance(exc, (RankFailures, CheckpointException)) and not _no_dist() and self.world_size > 1
        if not every_rank:
            return self._judge(exc)
        return collectives.broadcast_object(self._judge(exc) if self.is_coordinator else None,
                                            group=self.process_group)

    def _judge(self, exc: BaseException) -> Tuple[Optional[str], Optional[str]]:
        """``_judged``'s answer, read here; it never raises (the broadcast that follows must be reached)."""
        newer = newer_owner(self.lease_root, self.attempt)
        if newer is not None or storage_errno(exc) is None:
            return newer, None
        try:
            newest = latest_committed(self.root)
            return None, (f"the newest committed checkpoint, {newest.checkpoint_id}, is intact" if newest
                          else "there is no committed checkpoint yet")
        except Exception:  # noqa: BLE001 - the storage that failed the save may not answer a listing either
            return None, ("the committed checkpoints could not be listed, the storage did not answer; none was "
                          "written to")
