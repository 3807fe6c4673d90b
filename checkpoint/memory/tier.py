"""The memory tier: frequent snapshots in node-local shared memory, each replicated to a peer node.

A durable checkpoint goes to shared storage at the Young/Daly interval; a failure then costs half an
interval of work plus a reload from storage. The memory tier keeps a snapshot every few steps in a tmpfs
(``/dev/shm`` by default), which outlives a worker restart by torchrun, and with ``replicas: 1`` sends the
same bytes to the same local rank on the next node (a ring over nodes). A worker crash restores from its
own node's copy, a lost node from its peer's replica; neither reads storage.

This module is the tier's schedule, its pre-flight, the two halves of a snapshot and the restore
(docs/checkpoint-format.md, "The memory tier", has their steps). The training thread waits for the previous
snapshot (at most one in flight), copies the state into one reused flat host buffer and returns to training.
The background half (``persist``) writes, replicates and commits in two rounds, each phase agreed over the
tier's group so a rank that failed never leaves its peer waiting: a kill at any moment leaves the previous
complete step on every node until the new one is complete everywhere. The restore runs on every rank
together: the newest step with an intact copy of every rank, local or streamed from a peer; any problem
on any rank is agreed on, and the caller goes to the durable tier.

The tier's group (``PeerGroup``) is its own gloo group: its collectives run on the background thread,
apart from training's. Each rank sends its snapshot to ``peer`` (the rank ``local_world_size`` away: the
same local rank on the next node) and receives ``source``'s; every transfer is tagged, and every agreement
is a collective over the group.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from checkpoint.config import AUTO_MEASURE_STEPS
from checkpoint.durable import preflight as durable_preflight
from checkpoint.durable.discovery import checkpoint_id, parse
from checkpoint.durable.manifest import (
    APPLIED_BYTES,
    FORMAT_VERSION,
    CheckpointError,
    ConfigMismatch,
    Manifest,
    NewerFormat,
    default_algorithm,
)
from checkpoint.durable.preflight import PreflightError
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.snapshot import (
    STEP_DIR,
    FlatStager,
    HashedWriter,
    SnapshotError,
    Staged,
    apply_snapshot,
    check_applied,
    checksum_buffer,
    write_snapshot,
)
from checkpoint.storage import location
from parallel import collectives

log = logging.getLogger("trainer")

_TAG_HEADER, _TAG_INFO, _TAG_DATA, _TAG_PREFIX = 11, 12, 13, 14  # the tier's transfers (PeerGroup)
SPARE_DIR = "spare"  # MemoryTier.spare: files of dropped copies, written over by the next ones
_TAG_CHUNK = 1 << 16  # + i: the i-th chunk of a replica streamed by exchange()
STREAM_CHUNK = 8 << 20  # bytes of a replica's chunk on the wire
STREAM_DEPTH = 3  # chunks a receiver has posted at once: one being written while the next ones arrive


class GroupError(RuntimeError):
    """A collective of the tier's group failed on this rank (PeerGroup._collective)."""


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


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
    transfer_s: float = 0.0  # of replica_s, from the first byte sent to the last written (the rest: headers, rename)

    @property
    def blocking_s(self) -> float:  # what recovery/runtime.py's AutoInterval reads, as of a durable save
        return self.stall_s


@dataclass
class Restored:
    """What ``restore`` did. ``problem`` set: the state may be partly overwritten and the caller
    must load the durable tier."""

    step: int
    manifest: Optional[Manifest]
    sources: Dict[int, str] = field(default_factory=dict)  # rank -> local | peer
    problem: Optional[str] = None
    timings: Dict[str, float] = field(default_factory=dict)


def memory_root(mcfg: MemoryTierConfig, run_name: str) -> Path:
    """The tier's folder on this node (node-local): checkpoint.memory.root, or /dev/shm/<user>/<run_name>."""
    return Path(mcfg.root) if mcfg.root else Path("/dev/shm") / getpass.getuser() / run_name


class MemoryTier:
    @classmethod
    def of(cls, mcfg: MemoryTierConfig, ckpt, run_name: str) -> "MemoryTier":
        """The tier of a checkpoint manager (checkpoint/manager.py), when checkpoint.memory turns it on: it
        shares the manager's rank, layout, config hash, fault hook and events."""
        tier = cls(mcfg, run_name=run_name, rank=ckpt.rank, world_size=ckpt.world_size,
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", ckpt.world_size)), layout=ckpt.layout,
                   config_hash=ckpt.config_hash, algorithm=default_algorithm(),
                   pin_memory=ckpt.device.type == "cuda", timeout_s=ckpt.cfg.commit_timeout_s,
                   fault_hook=ckpt.fault_hook, log_event=ckpt.log_event)
        if tier.auto:  # recovery/runtime.py measures a first snapshot, then sets the interval
            tier.set_interval(AUTO_MEASURE_STEPS)
        return tier

    def __init__(self, mcfg, *, run_name: str, rank: int, world_size: int, local_world_size: int,
                 layout: Dict[str, int], config_hash: str, algorithm: str, pin_memory: bool = False,
                 timeout_s: float = 600.0, fault_hook: Optional[Callable[..., None]] = None,
                 log_event: Optional[Callable[..., None]] = None):
        self.cfg = mcfg
        self.log_event = log_event or (lambda step, **fields: None)  # the manager's: metrics.jsonl
        self.auto = str(mcfg.interval).strip().lower() == "auto"
        self.records: List[SnapshotRecord] = []  # the newest finished snapshots (checkpoint.memory.interval=auto)
        root = memory_root(mcfg, run_name)
        self.dir = root / f"node-{mcfg.node}" if mcfg.node is not None else root
        self.rank, self.world_size = rank, world_size
        self.local_world_size = max(1, local_world_size)
        self.layout, self.config_hash, self.algorithm = dict(layout), config_hash, algorithm
        self.interval = int(mcfg.interval) if str(mcfg.interval) != "auto" else 0
        self.peers = PeerGroup(rank, world_size, self.local_world_size, int(mcfg.replicas), timeout_s)
        self.stager = FlatStager(pin_memory)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="memory-snapshot")
        self._in_flight: Optional[Future] = None
        self._finished: List[SnapshotRecord] = []
        self.enabled = True
        self.fault_hook = fault_hook or (lambda phase, step, path=None: None)  # recovery/faults.py

    # -- pre-flight ------------------------------------------------------------------------
    def preflight(self, state_bytes: int, shared_staging_bytes: int = 0) -> Optional[str]:
        """Room for this node's snapshots: every local rank's own copy and replica, twice (the newest
        complete and the one being written), plus ``shared_staging_bytes`` (this node's async_process staging,
        checkpoint/durable/staging.py) when /dev/shm is the same file system. Returns the problem, or None."""
        copies = 2 if self.peers.peer is not None else 1
        need = 2 * copies * self.local_world_size * state_bytes
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            usage = shutil.disk_usage(self.dir)
            same = shared_staging_bytes and self.dir.stat().st_dev == durable_preflight.SHM.stat().st_dev
            staging = shared_staging_bytes if same else 0
        except OSError as exc:
            return f"checkpoint.memory.root: cannot create {self.dir}: {exc}"
        held = sum(p.stat().st_size for p in self.dir.rglob("*.snap") if p.is_file())
        free = usage.free + held  # what this run holds now is replaced, not added to
        if free >= need + staging:
            return None
        also = (f" + {size_text(staging)} of checkpoint.async_mode=async_process staging in the same file system"
                if staging else "")
        n = self.local_world_size
        return (f"the memory tier needs {size_text(need + staging)} in {self.dir} ({n} rank{'s' if n > 1 else ''} on "
                f"this node x {size_text(state_bytes)} of state x {copies} cop{'ies' if copies > 1 else 'y'} "
                f"(own{' + replica' if copies > 1 else ''}) x 2 (newest + being written)){also}, but its file system "
                f"has "
                f"{size_text(free)} free of {size_text(usage.total)}. Enlarge it (docker run --shm-size, "
                "or mount -o remount,size=... /dev/shm), point checkpoint.memory.root at a larger tmpfs, or set "
                "checkpoint.memory.required=false to train on the durable tier alone")

    def agreed_preflight(self, state_bytes: int, shared_staging_bytes: int = 0) -> None:
        """``preflight`` on every rank, agreed: one node short of room stops every rank (PreflightError) or, with
        checkpoint.memory.required=false, turns the tier off on every rank."""
        problem = self.peers.agree(self.preflight(state_bytes, shared_staging_bytes))
        if problem is not None and self.cfg.required:
            raise PreflightError(problem)
        if problem is not None:
            log.warning("%s. checkpoint.memory.required=false: training on the durable tier alone", problem)
            self.enabled = False

    # -- snapshots -------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and self.interval > 0 and step % self.interval == 0

    def set_interval(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"memory snapshot interval {steps} must be >= 1")
        self.interval = int(steps)

    def after_step(self, step: int, loss: float, ckpt) -> None:
        """After every optimizer step: a snapshot of ``ckpt``'s state when due (its manifest built by ``ckpt``,
        with no probe: the restore compares the applied bytes), else a poll."""
        if not self.due(step):
            self.poll()
            return
        started = time.perf_counter()  # the manifest's build counts in the stall
        manifest = ckpt.build_manifest(step, loss, probe_method=APPLIED_BYTES)  # sets the state's metadata
        self.snapshot(step, ckpt.state.state_dict(), manifest, started)

    def snapshot(self, step: int, state_dict: Dict[str, Any], manifest: Manifest,
                 started: Optional[float] = None) -> None:
        """Stage ``state_dict`` (the training thread's only cost) and write and replicate it in the
        background. ``started``: when the snapshot began (before its manifest was built), for its stall."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        t0 = t0 if started is None else started
        staged = self.stager.stage(state_dict)
        self.fault_hook("memory_snapshot", step)  # e.g. a slow host copy on one rank (the tests)
        stall = time.perf_counter() - t0
        info = {"step": step, "owner": self.rank, "world_size": self.world_size, "layout": self.layout,
                "config_hash": self.config_hash, "algorithm": self.algorithm,
                "manifest": json.loads(manifest.to_json())}
        self._in_flight = self._executor.submit(persist, self, step, staged, info, stall, waited)

    @property
    def group_failed(self) -> bool:
        """The tier's group failed on this rank (GroupError): a flag of the step's agreement, which
        calls ``turn_off`` on every rank (recovery/runtime.py)."""
        return self.enabled and self.peers.failure is not None

    def turn_off(self, step: int) -> None:
        """Agreed at the end of ``step``: the tier's group failed on some rank, so its ranks may be at
        different points of the protocol. Every rank stops snapshotting at this same step, for the rest
        of this attempt (a restart makes a new group); the durable tier goes on."""
        self.enabled = False
        why = self.peers.failure or "the memory tier's group failed on another rank"
        log.error("%s: memory snapshots are off from step %d for the rest of this attempt (the durable tier "
                  "goes on; a restart makes a new group)", why, step)
        self.log_event(step, kind="alarm", check="memory_tier_group", action="memory_tier_off", message=why[:2000])

    def poll(self) -> None:
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def wait(self) -> None:
        """Until the snapshot in flight is done on this rank. A failed snapshot is logged, not raised:
        the durable tier is still there, and the next interval tries again."""
        fut, self._in_flight = self._in_flight, None
        if fut is None:
            return
        try:
            self._finished.append(fut.result())
        except Exception as exc:
            log.error("memory snapshot failed (training goes on; the durable tier is unaffected): %s: %s",
                      type(exc).__name__, exc)

    def finished(self) -> List[SnapshotRecord]:
        out, self._finished = self._finished, []
        return out

    def report(self) -> List[SnapshotRecord]:
        """Log the snapshots finished since the last call (and record them in metrics.jsonl); keep the newest."""
        done = self.finished()
        for r in done:
            log.debug("memory snapshot of step %d: stalled training %.3f s, background %.3f s (replica %.3f s), "
                      "%.1f MiB%s", r.step, r.stall_s, r.background_s, r.replica_s, r.bytes / 2**20,
                      ", complete" if r.committed else ", NOT complete")
            self.log_event(r.step, kind="memory_snapshot", stall_s=round(r.stall_s, 4), waited_s=round(r.waited_s, 4),
                           background_s=round(r.background_s, 4), replica_s=round(r.replica_s, 4), bytes=r.bytes,
                           replica_bytes=r.replica_bytes, committed=r.committed)
        self.records = (self.records + done)[-16:]
        return done

    def take_records(self) -> List[SnapshotRecord]:
        """The snapshots finished since the last call (logged already): what checkpoint.memory.interval=auto
        measures."""
        out, self.records = self.records, []
        return out

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.stager.close()
            self.peers.close()

    def discard(self) -> None:
        """Delete this node's snapshots (the run finished: they would only hold memory)."""
        self.wait()
        drop_steps(self.dir, lambda s: True)
        shutil.rmtree(self.dir / SPARE_DIR, ignore_errors=True)

    def spare(self, kind: str) -> Path:
        """Where this rank keeps the file of its ``kind`` copy (own or replica) of a dropped step, to write
        the next one over (HashedWriter's ``reuse``: no page of the tmpfs to allocate and clear). Preflight
        counts it as held: the tier never holds more than the newest step and the one being written."""
        return self.dir / SPARE_DIR / f"rank{self.rank:05d}-{kind}.snap"

    def recycle(self, drop: Callable[[int], bool]) -> None:
        """``drop_steps``, keeping this rank's two files of the newest dropped step as its spares: their
        commit files go first, so a kill in between leaves no commit without its copy. (Ranks of one
        node share the folder: one that deletes a step first leaves the others without spares, and
        they write new files.)"""
        steps = sorted((int(p.name[len("step_"):]), p) for p in self.dir.glob("step_*")
                       if p.name[len("step_"):].isdigit() and drop(int(p.name[len("step_"):])))
        if steps:
            old = steps[-1][1]
            owners = {"own": self.rank, "replica": self.peers.source}
            try:
                (self.dir / SPARE_DIR).mkdir(exist_ok=True)
                for owner in owners.values():
                    if owner is not None:
                        (old / f"rank{owner:05d}.json").unlink(missing_ok=True)
                for kind, owner in owners.items():
                    if owner is not None and (old / f"rank{owner:05d}.snap").is_file():
                        os.replace(old / f"rank{owner:05d}.snap", self.spare(kind))
            except OSError as exc:  # only a lost saving: the next snapshot writes new files
                log.debug("memory tier: no spare files kept from %s: %s", old, exc)
        drop_steps(self.dir, drop)

    # -- restore ---------------------------------------------------------------------------
    def forget_newer(self, step: int) -> None:
        """Drop this node's copies of every step after ``step``: a resume went back past them."""
        drop_steps(self.dir, lambda s: s > step)

    def resume(self, ckpt, verify, newest: Optional[Path]) -> Optional[str]:
        """Resume ``ckpt``'s state (a CheckpointManager) from the newest step every rank can get an intact copy
        of, newer than ``newest`` (the newest committed durable checkpoint, agreed), verified like a durable
        load. What happened (for the banner), or None: go on to the durable tier (nothing usable, or the
        snapshot failed and was forgotten)."""
        t0 = time.perf_counter()
        restored = restore(self, ckpt.state, newer_than=parse(newest.name)[0] if newest is not None else 0,
                           allow_config_change=ckpt.cfg.allow_config_change)
        if restored is None:
            return None
        problem = self.peers.agree(restored.problem)
        where = self.dir / STEP_DIR.format(restored.step)
        if problem is None and verify is not None:
            problem = self.peers.agree(verify(restored.manifest, where))
        if problem is not None:
            shutil.rmtree(where, ignore_errors=True)  # forgotten: the next restart does not retry it
            log.error("the memory snapshot of step %d failed to load or verify: %s; falling back to the durable tier",
                      restored.step, problem)
            ckpt.log_event(restored.step, kind="memory_restore_failed", problem=problem[:2000])
            if newest is None:
                raise CheckpointError(
                    f"the memory snapshot of step {restored.step} failed to load or verify ({problem}) and "
                    f"{ckpt.root} has no committed checkpoint to fall back to; the live state is partly overwritten, "
                    "so this attempt stops. The snapshot is forgotten: a restart starts afresh")
            return None
        seconds = time.perf_counter() - t0
        sources = ", ".join(f"rank {r} {s}" for r, s in sorted(restored.sources.items()))
        log.info("resumed step %d from the memory tier in %.2f s (%s): %s", restored.step, seconds,
                 ", ".join(f"{k} {v:.2f} s" for k, v in restored.timings.items()), sources)
        ckpt.log_event(restored.step, kind="resume", checkpoint_id=checkpoint_id(restored.step), path=str(where),
                       load_s=round(seconds, 3), skipped=[], source="memory",
                       sources={str(r): s for r, s in restored.sources.items()},
                       saved_world_size=ckpt.world_size, saved_layout=dict(ckpt.layout), **restored.timings)
        return f"from the memory tier (step {restored.step}; {sources})"


# -- a snapshot's background half --------------------------------------------------------------------
def persist(tier, step: int, staged: Staged, info: dict, stall: float, waited: float) -> SnapshotRecord:
    """Write, exchange, commit; each phase agreed over the group. Whatever fails on a rank inside a phase
    (a full tmpfs, a failed rename, a bad replica) is that rank's "not ok" at the phase's agreement, so
    every rank leaves the snapshot at the same point and the group stays in step for the next one. A failed
    collective (GroupError) ends the snapshot here; the step's agreement then turns the tier off."""
    t0 = time.perf_counter()
    d = tier.dir / STEP_DIR.format(step)
    got: Dict[str, Any] = {"size": 0, "replica": None, "replica_s": 0.0}

    def record(committed: bool) -> SnapshotRecord:
        replica = got["replica"]
        return SnapshotRecord(step, stall, waited, time.perf_counter() - t0, got["replica_s"], got["size"],
                              replica["size"] if replica is not None else 0, committed,
                              tier.peers.transfer_s if replica is not None else 0.0)

    def phase(what: str, work: Callable[[], None]) -> bool:
        """``work`` on this rank, then agreed: True on every rank iff it succeeded on every rank."""
        try:
            work()
            ok = True
        except GroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is this rank's "not ok", never a skipped agreement
            log.error("memory snapshot of step %d failed: %s on rank %d: %s: %s", step, what, tier.rank,
                      type(exc).__name__, exc)
            ok = False
        return tier.peers.all_ok(ok)

    def write() -> None:
        d.mkdir(parents=True, exist_ok=True)
        for owner in {tier.rank, tier.peers.source if tier.peers.source is not None else tier.rank}:
            (d / f"rank{owner:05d}.json").unlink(missing_ok=True)  # a commit of an earlier try of this step
        got["size"], checksum = write_snapshot(d / f"rank{tier.rank:05d}.snap", staged, tier.algorithm,
                                               tier.spare("own"))
        info.update(size=got["size"], checksum=checksum)

    def exchange() -> None:
        t1 = time.perf_counter()
        try:
            got["replica"] = tier.peers.exchange(  # the fault hook at each write of the replica (the tests)
                staged, info, d, lambda: tier.fault_hook("memory_replica_write", step, path=d), tier.spare("replica"))
            tier.fault_hook("memory_replica", step, path=d)  # the replica is in place (the tests)
        finally:
            got["replica_s"] = time.perf_counter() - t1

    def commit() -> None:  # the .json files: a copy without one is ignored
        tier.fault_hook("memory_commit", step, path=d)  # e.g. a full tmpfs (the tests)
        location(d / f"rank{tier.rank:05d}.json").write_text(json.dumps(info))
        if got["replica"] is not None:
            location(d / f"rank{got['replica']['owner']:05d}.json").write_text(json.dumps(got["replica"]))

    try:
        if not (phase("writing", write) and (tier.peers.peer is None or phase("the replica exchange", exchange))
                and phase("the commit", commit)):
            shutil.rmtree(d, ignore_errors=True)  # failed on every rank: the older complete step stays
            return record(False)
    except GroupError as exc:
        log.error("memory snapshot of step %d failed on rank %d: %s", step, tier.rank, exc)
        return record(False)
    tier.recycle(lambda s: s < step)  # every rank committed step: the older ones can go
    return record(True)


def drop_steps(directory: Path, drop: Callable[[int], bool]) -> None:
    """Delete the step folders in ``directory`` whose step ``drop`` picks."""
    for d in directory.glob("step_*"):
        if d.name[len("step_"):].isdigit() and drop(int(d.name[len("step_"):])):
            shutil.rmtree(d, ignore_errors=True)


# -- the tier's group: agreements, the replica exchange, copies streamed to a peer -----------------
class PeerGroup:
    def __init__(self, rank: int, world_size: int, local_world_size: int, replicas: int, timeout_s: float):
        self.rank, self.world_size, self.local_world_size = rank, world_size, max(1, local_world_size)
        self.peer: Optional[int] = None  # who receives this rank's replica
        self.source: Optional[int] = None  # whose replica this rank holds
        if replicas > 0:
            if world_size > self.local_world_size:
                self.peer = (rank + self.local_world_size) % world_size
                self.source = (rank - self.local_world_size) % world_size
            elif rank == 0:
                log.warning("checkpoint.memory.replicas=1 needs more than one node (world %d, %d ranks per node): "
                            "snapshots stay on their own node only", world_size, self.local_world_size)
        self.group = None
        self.failure: Optional[str] = None  # a collective of the group failed: it is not used again (GroupError)
        self._chunks: List[torch.Tensor] = []  # the replica's receive buffers, reused (_transfer)
        self.transfer_s = 0.0  # the last exchange's time from its first byte sent to its last written
        if collectives.distributed() and world_size > 1:
            self.group = collectives.new_gloo_group(timeout_s)

    @contextmanager
    def _collective(self) -> Iterator[None]:
        """Around one collective step of the tier's protocol. If it fails (a timeout, a peer gone, a rank
        that could not take part), the ranks may be at different points of the protocol now: the group
        is never used again on this rank (GroupError), and recovery/runtime.py's step agreement turns
        the tier off on every rank."""
        if self.failure is not None:
            raise GroupError(self.failure)
        try:
            yield
        except Exception as exc:
            self.failure = f"the memory tier's group failed on rank {self.rank}: {type(exc).__name__}: {exc}"
            raise GroupError(self.failure) from exc

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank (over the tier's group)."""
        if self.group is None:
            return ok
        with self._collective():
            return not collectives.any_rank(not ok, self.group)

    def gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        with self._collective():
            return collectives.all_gather_object(obj, self.group)

    def agree(self, problem: Optional[str]) -> Optional[str]:
        """Every rank's problems, joined (naming the ranks that met each, unless all did), if any
        rank has one (else None); the same on every rank."""
        if self.group is None:
            return problem
        with self._collective():
            return collectives.agree_on_problems(problem, self.group)

    def exchange(self, staged: Staged, info: dict, d: Path, before_write: Optional[Callable[[], None]] = None,
                 reuse: Optional[Path] = None) -> dict:
        """Send this rank's staged snapshot to the peer and receive the source's (``_transfer``), each
        chunk of it written to ``d`` and hashed while the next arrives. A write that fails (a full tmpfs)
        drops the rest of the replica's writes but not its receives, so the sender is never left
        hanging; the failure is raised once every byte arrived. ``before_write``, ``reuse``: HashedWriter's."""
        replica_tmp = d / f"replica-from-{self.source:05d}"
        with self._collective():
            received, writer, size_in = self._transfer(staged, info, replica_tmp, before_write, reuse)
        if isinstance(received, Exception):  # the source's info did not parse: nothing was written
            raise SnapshotError(f"the replica's description from rank {self.source} is unreadable: {received!r}")
        try:
            written, got = writer.finish()
        except OSError as exc:
            raise SnapshotError(f"no room for the replica of rank {received['owner']} ({size_text(size_in)}) "
                                f"in {d}: {exc}") from exc
        if got != received["checksum"] or not received["size"] == written == size_in:
            replica_tmp.unlink(missing_ok=True)
            raise SnapshotError(f"replica of rank {received['owner']} step {received['step']} arrived damaged "
                                f"(checksum {got} != {received['checksum']})")
        os.replace(replica_tmp, d / f"rank{received['owner']:05d}.snap")
        return received

    def _transfer(self, staged: Staged, info: dict, replica: Path, before_write=None, reuse=None):
        """The exchange's bytes on the wire: (the source's info, or the exception parsing it; the
        HashedWriter that holds its snapshot in ``replica``; the size announced). Every send goes from
        the staging buffer itself (not read back from the file), in ``STREAM_CHUNK`` pieces posted at
        once. Over a spare file (``reuse``) the source's chunks are received straight into its mapped
        pages and hashed there as each arrives; otherwise they come into ``STREAM_DEPTH`` buffers of one
        chunk each, reused round a ring: while one is written to tmpfs and hashed (cache-hot, just
        arrived), the next ones arrive. No buffer of the whole replica either way. Each chunk has its
        own tag, so the order of the matches is the order of the posts whatever gloo's queueing."""
        info_out = torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)
        prefix_out = torch.frombuffer(bytearray(staged.prefix), dtype=torch.uint8)
        region = staged.region
        header_out = torch.tensor([info_out.numel(), prefix_out.numel(), region.numel(), STREAM_CHUNK],
                                  dtype=torch.int64)
        header_in = torch.empty(4, dtype=torch.int64)
        collectives.exchange([(header_out, self.peer, _TAG_HEADER)], [(header_in, self.source, _TAG_HEADER)],
                             self.group)
        info_len, prefix_len, region_len, chunk_in = (int(x) for x in header_in)
        t0 = time.perf_counter()
        sends = [collectives.isend(info_out, self.peer, self.group, _TAG_INFO),
                 collectives.isend(prefix_out, self.peer, self.group, _TAG_PREFIX)]
        sends += [collectives.isend(region[start:start + STREAM_CHUNK], self.peer, self.group, _TAG_CHUNK + i)
                  for i, start in enumerate(range(0, region.numel(), STREAM_CHUNK))]
        info_in = torch.empty(info_len, dtype=torch.uint8)
        prefix_in = torch.empty(prefix_len, dtype=torch.uint8)
        for work in (collectives.irecv(info_in, self.source, self.group, _TAG_INFO),
                     collectives.irecv(prefix_in, self.source, self.group, _TAG_PREFIX)):
            work.wait()
        try:
            received = json.loads(info_in.numpy().tobytes())
            writer = HashedWriter(replica, received["algorithm"], before_write, reuse)
        except Exception as exc:  # noqa: BLE001 - raised by exchange() once the stream is drained
            received, writer = exc, None
        if writer is not None:
            writer.write(prefix_in)
        starts = list(range(0, region_len, chunk_in))

        def post(i: int):
            buf = self._chunks[i % len(self._chunks)][:min(chunk_in, region_len - starts[i])]
            return buf, collectives.irecv(buf, self.source, self.group, _TAG_CHUNK + i)

        try:
            # over a spare file: the chunks go from the socket straight into its pages, hashed there
            into = writer.mapped(prefix_len + region_len) if writer is not None and region_len else None
            if into is not None:
                works = [collectives.irecv(into[prefix_len + at:prefix_len + at + chunk_in], self.source, self.group,
                                           _TAG_CHUNK + i) for i, at in enumerate(starts)]
                for i, at in enumerate(starts):
                    works[i].wait()
                    writer.hashed(into[prefix_len + at:prefix_len + at + chunk_in])
                starts, self._chunks = [], []  # the ring is not needed while there are spares
            ring, size = min(STREAM_DEPTH, len(starts)), min(chunk_in, region_len)
            if ring and (len(self._chunks) != ring or self._chunks[0].numel() != size):
                self._chunks = []
                self._chunks = [torch.empty(size, dtype=torch.uint8) for _ in range(ring)]
            posted = [post(i) for i in range(ring)]
            for i in range(len(starts)):
                buf, work = posted[i]
                work.wait()
                if writer is not None:
                    writer.write(buf)  # a failure is kept: the rest is only received
                if i + len(self._chunks) < len(starts):
                    posted.append(post(i + len(self._chunks)))
            for work in sends:
                work.wait()
        except BaseException:  # the group failed (GroupError follows): no half-written replica stays open
            if writer is not None:
                writer.abort()
            raise
        self.transfer_s = time.perf_counter() - t0
        return received, writer, prefix_len + region_len

    def close(self) -> None:
        self._chunks = []

    def send_copy(self, copy: dict, to: int) -> None:
        """Stream one held copy to rank ``to``: header (size, manifest length), manifest, bytes. The copy
        is verified here first: one that cannot be read or fails its checksum is announced with size -1,
        so the receiver does not wait for it and no damaged bytes cross the network."""
        try:
            data = torch.from_file(copy["path"], shared=False, size=copy["size"], dtype=torch.uint8)
            if checksum_buffer(data.numpy(), copy["algorithm"]) != copy["checksum"]:
                raise SnapshotError(f"{copy['path']} fails its checksum")
            meta = torch.frombuffer(bytearray(json.dumps(copy).encode()), dtype=torch.uint8)
        except Exception as exc:  # noqa: BLE001 - the receiver waits for a header whatever went wrong
            log.error("memory tier: the copy of rank %d held here cannot be sent: %s: %s", to, type(exc).__name__,
                      exc)
            with self._collective():
                collectives.send(torch.tensor([-1, 0], dtype=torch.int64), to, self.group, tag=_TAG_HEADER)
            return
        with self._collective():
            collectives.send(torch.tensor([copy["size"], meta.numel()], dtype=torch.int64), to, self.group,
                             tag=_TAG_HEADER)
            collectives.send(meta, to, self.group, tag=_TAG_INFO)
            collectives.send(data, to, self.group, tag=_TAG_DATA)

    def receive_copy(self, holder: int):
        """(bytes, its manifest, problem) of this rank's copy streamed from ``holder``."""
        header = torch.empty(2, dtype=torch.int64)
        with self._collective():
            collectives.recv(header, holder, self.group, tag=_TAG_HEADER)
        size, meta_len = int(header[0]), int(header[1])
        if size < 0:
            return None, None, (f"rank {self.rank}: the copy held by rank {holder} is unreadable or damaged "
                                f"(rank {holder}'s log says which)")
        meta = torch.empty(meta_len, dtype=torch.uint8)
        buf = torch.empty(size, dtype=torch.uint8)
        with self._collective():
            collectives.recv(meta, holder, self.group, tag=_TAG_INFO)
            collectives.recv(buf, holder, self.group, tag=_TAG_DATA)
        try:  # a problem here is agreed on; raised, it would skip this rank's sends later in the restore
            copy = json.loads(meta.numpy().tobytes())
            intact = checksum_buffer(buf.numpy(), copy["algorithm"]) == copy["checksum"]
        except Exception as exc:  # noqa: BLE001
            return None, None, f"rank {self.rank}: the copy streamed from rank {holder} is unreadable: {exc!r}"
        if not intact:
            return None, None, f"rank {self.rank}: the replica streamed from rank {holder} arrived damaged"
        return buf, copy.get("manifest"), None


# -- the restore: on every rank together -------------------------------------------------------------
def held_copies(directory: Path) -> List[dict]:
    """The committed copies in this node's directory (any owner)."""
    out = []
    for meta in sorted(directory.glob("step_*/rank*.json")):
        try:
            info = json.loads(meta.read_text())
            info["path"] = str(meta.with_suffix(".snap"))
            out.append(info)
        except (OSError, ValueError) as exc:
            log.warning("memory tier: unreadable copy manifest %s (%s): ignored", meta, exc)
    return out


def restore(tier, state, newer_than: int = 0, allow_config_change: bool = False) -> Optional[Restored]:
    """Restore ``state`` from the newest step newer than ``newer_than`` (the newest durable checkpoint) that
    every rank can get an intact copy of; None: nothing usable, nothing touched. A snapshot taken with another
    config is refused as a durable resume refuses it (ConfigMismatch), unless ``allow_config_change``."""
    t0 = time.perf_counter()
    held = held_copies(tier.dir)
    everyone = tier.peers.gather([{k: v for k, v in h.items() if k != "manifest"} | {
        "holder": tier.rank, "format_version": (h.get("manifest") or {}).get("format_version", FORMAT_VERSION)}
        for h in held])
    copies = [c for per_rank in everyone for c in per_rank]
    if not copies:
        return None
    usable = [c for c in copies if c["world_size"] == tier.world_size and c["layout"] == tier.layout]
    if not usable:
        c = copies[0]
        if tier.rank == 0:
            log.warning("memory tier: the snapshots in memory were taken at world %d, layout %s; this run has "
                        "world %d, layout %s: they are ignored, resuming from the durable tier", c["world_size"],
                        c["layout"], tier.world_size, tier.layout)
        return None
    _check_config(tier, [c for c in usable if c["step"] > newer_than], allow_config_change)
    for step in sorted({c["step"] for c in usable}, reverse=True):
        if step <= newer_than:
            if tier.rank == 0:
                log.info("memory tier: the newest snapshot (step %d) is not newer than the durable checkpoint of "
                         "step %d: resuming from the durable tier", step, newer_than)
            return None
        at_step = [c for c in usable if c["step"] == step]
        if {c["owner"] for c in at_step} != set(range(tier.world_size)):
            continue
        restored = _restore_step(tier, state, step, at_step, [h for h in held if h["step"] == step], t0)
        if restored is not None:
            return restored
    if tier.rank == 0:
        log.warning("memory tier: no step has an intact copy for every rank: resuming from the durable tier")
    return None


def _check_config(tier, newer: List[dict], allow_config_change: bool) -> None:
    formats = sorted({c["format_version"] for c in newer if c["format_version"] > FORMAT_VERSION})
    if formats:  # no flag allows it, as for a durable checkpoint
        steps = sorted({c["step"] for c in newer if c["format_version"] > FORMAT_VERSION})
        raise NewerFormat(f"the memory tier's snapshots of step(s) {steps} in {tier.dir} were taken by a newer "
                          f"trainer (manifest format {formats[-1]}; this checkout reads formats up to "
                          f"{FORMAT_VERSION}). Resume with that trainer's checkout, or remove {tier.dir} to resume "
                          "from the durable tier")
    changed = sorted({c["step"] for c in newer if c.get("config_hash") != tier.config_hash})
    if not changed:
        return
    hashes = sorted({str(c.get("config_hash")) for c in newer if c["step"] in changed})
    msg = (f"the memory tier's snapshots of step(s) {changed} were taken with another config (hash "
           f"{', '.join(hashes)}; this run {tier.config_hash})")
    if not allow_config_change:
        raise ConfigMismatch(msg + ". Resume with the same settings, set checkpoint.allow_config_change=true to "
                                   "accept the change, or checkpoint.resume=never to start afresh")
    if tier.rank == 0:
        log.warning("checkpoint.allow_config_change=true: %s", msg)


def _holder(tier, r: int, at_step: List[dict]) -> Optional[int]:
    """The rank that streams rank ``r``'s copy when ``r``'s own failed its check: one on another node,
    since a copy's holders are the ranks of the node where it lives (they list one directory) and a
    rank beside ``r`` would stream the same damaged file. The next node of the ring first (it holds
    the replica), and there the rank that received it (``r``'s local rank)."""
    per_node = tier.local_world_size
    nodes = max(1, -(-tier.world_size // per_node))
    holders = {c["holder"] for c in at_step if c["owner"] == r and c["holder"] // per_node != r // per_node}
    if not holders:
        return None
    return min(holders, key=lambda h: ((h // per_node - r // per_node) % nodes, h % per_node != r % per_node, h))


def _restore_step(tier, state, step: int, at_step: List[dict], mine: List[dict], t0: float) -> Optional[Restored]:
    t1 = time.perf_counter()
    own, own_buf = next((h for h in mine if h["owner"] == tier.rank), None), None
    if own is not None:  # this rank's own copy is verified here; a replica by its sender and its receiver
        try:
            data = torch.from_file(own["path"], shared=False, size=own["size"], dtype=torch.uint8)
            if checksum_buffer(data.numpy(), own["algorithm"]) == own["checksum"]:
                own_buf = data
            else:
                log.error("memory tier: the copy of rank %d step %d in %s fails its checksum", tier.rank, step,
                          own["path"])
        except Exception as exc:  # noqa: BLE001 - not intact, agreed on below
            log.error("memory tier: the copy of rank %d step %d is unreadable: %s: %s", tier.rank, step,
                      type(exc).__name__, exc)
    verify_s = time.perf_counter() - t1
    own_intact = tier.peers.gather(own_buf is not None)
    sources = {r: r if own_intact[r] else _holder(tier, r, at_step) for r in range(tier.world_size)}
    missing = [r for r, h in sources.items() if h is None]
    if missing:
        if tier.rank == 0:
            log.warning("memory tier: step %d has no intact copy for rank(s) %s", step, missing)
        return None
    t2 = time.perf_counter()
    buf, problem, manifest_json = None, None, None
    for r in range(tier.world_size):  # one transfer at a time, in rank order: every rank agrees on it
        h = sources[r]
        if h == r:
            if r == tier.rank:
                buf, manifest_json = own_buf, own.get("manifest")
        elif tier.rank == h:
            tier.peers.send_copy(next(x for x in mine if x["owner"] == r), r)
        elif tier.rank == r:
            buf, manifest_json, problem = tier.peers.receive_copy(h)
    read_s = time.perf_counter() - t2
    manifest, apply_s, check_s = None, 0.0, 0.0
    if problem is None:
        try:
            t3 = time.perf_counter()
            manifest = Manifest.from_json(json.dumps(manifest_json))
            apply_snapshot(state, buf)
            t4 = time.perf_counter()
            check_applied(state, buf)  # instead of the probe's forward (snapshot.py says why)
            apply_s, check_s = t4 - t3, time.perf_counter() - t4
        except Exception as exc:  # noqa: BLE001 - a copy that does not apply is a problem to agree on
            problem = f"rank {tier.rank}: {type(exc).__name__}: {exc}"
    names = {r: "local" if h == r else "peer" for r, h in sources.items()}
    timings = {"verify_s": round(verify_s, 3), "read_s": round(read_s, 3), "apply_s": round(apply_s, 3),
               "check_s": round(check_s, 3), "total_s": round(time.perf_counter() - t0, 3)}
    return Restored(step, manifest, names, problem, timings)
