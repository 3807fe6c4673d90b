"""The memory tier: frequent snapshots in node-local shared memory, each replicated to a peer node.

A durable checkpoint goes to shared storage at the Young/Daly interval; a failure then costs
half an interval of work plus a reload from storage. The memory tier (checkpoint.memory) keeps
a snapshot every few steps in a tmpfs directory (``/dev/shm`` by default), which outlives a
worker restart by torchrun, and with ``replicas: 1`` sends the same bytes to the rank
``local_world_size`` away: the same local rank on the next node, a ring over nodes. A worker
crash restores from its own node's copy, a lost node from its peer's replica, and neither
reads storage. The durable tier keeps running at its own interval.

A snapshot of step S, on every rank:
  1. training thread: wait for the previous snapshot (at most one in flight), copy the state
     into reused host buffers (checkpoint/state/staging.py), return to training;
  2. background thread: write ``step_S/rankR.snap`` (checkpoint/memory/snapshot.py, checksummed as it
     is written); exchange with the peers over the tier's own gloo group: send this file to
     the peer, receive the source rank's file straight into ``step_S/rankQ.snap`` and check its
     checksum;
  3. agree over the group that every rank holds both copies; then write each copy's manifest
     (``rankR.json``: step, owner, world, layout, size, checksum, the durable-style manifest for
     post-load verification), which is the commit: a copy without one is ignored;
  4. agree again that every rank committed, then delete the older steps. So a kill at any
     moment leaves the previous complete step on every node until the new one is complete
     everywhere: the newest complete snapshot and the one being written are all that is kept.

Restore (``restore``), on every rank together: each rank lists the committed copies its node
holds, all ranks gather the lists and pick the newest step for which every rank has a copy at
this world size and layout; holders check the checksums of their copies; each rank then takes
its own node's copy (local) or, failing that, a peer's, streamed over the group (peer). Any
problem on any rank (no intact copy, a copy that does not apply) is agreed on and reported, and
the caller goes to the durable tier.

Node identity: one tmpfs per host, so by default the directory is ``root`` itself. On a
machine that plays several nodes (tests: two torchrun agents on one host)
``checkpoint.memory.node`` gives each its own ``root/node-<id>``.
"""

from __future__ import annotations

import datetime
import getpass
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from checkpoint.durable.integrity import atomic_write_text
from checkpoint.durable.manifest import Manifest
from checkpoint.memory.snapshot import SnapshotError, apply_snapshot, checksum_buffer, write_snapshot
from checkpoint.state.staging import HostStager

log = logging.getLogger("trainer")

STEP_DIR = "step_{:08d}"
_TAG_HEADER, _TAG_INFO, _TAG_DATA = 11, 12, 13


def default_root(run_name: str) -> Path:
    """Node-local shared memory, one directory per user and run."""
    return Path("/dev/shm") / getpass.getuser() / run_name


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

    @property
    def blocking_s(self) -> float:  # what recovery/runtime.py's AutoInterval reads, as of a durable save
        return self.stall_s


@dataclass
class Restored:
    """What ``MemoryTier.restore`` did. ``problem`` set: the state may be partly overwritten and
    the caller must load the durable tier."""

    step: int
    manifest: Optional[Manifest]
    sources: Dict[int, str] = field(default_factory=dict)  # rank -> local | peer
    problem: Optional[str] = None
    timings: Dict[str, float] = field(default_factory=dict)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


class MemoryTier:
    def __init__(self, mcfg, *, run_name: str, rank: int, world_size: int, local_world_size: int,
                 layout: Dict[str, int], config_hash: str, algorithm: str, pin_memory: bool = False,
                 timeout_s: float = 600.0):
        self.cfg = mcfg
        root = Path(mcfg.root) if mcfg.root else default_root(run_name)
        self.dir = root / f"node-{mcfg.node}" if mcfg.node is not None else root
        self.rank, self.world_size = rank, world_size
        self.local_world_size = max(1, local_world_size)
        self.layout, self.config_hash, self.algorithm = dict(layout), config_hash, algorithm
        self.interval = int(mcfg.interval) if str(mcfg.interval) != "auto" else 0
        self.peer: Optional[int] = None  # who receives this rank's replica
        self.source: Optional[int] = None  # whose replica this rank holds
        if int(mcfg.replicas) > 0:
            if world_size > self.local_world_size:
                self.peer = (rank + self.local_world_size) % world_size
                self.source = (rank - self.local_world_size) % world_size
            elif rank == 0:
                log.warning("checkpoint.memory.replicas=1 needs more than one node (world %d, %d ranks per node): "
                            "snapshots stay on their own node only", world_size, self.local_world_size)
        self.group = None
        if _dist() and world_size > 1:  # its own group: collectives from the background thread
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.stager = HostStager(pin_memory)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="memory-snapshot")
        self._in_flight: Optional[Future] = None
        self._finished: List[SnapshotRecord] = []
        self.enabled = True

    # -- pre-flight ------------------------------------------------------------------------
    def preflight(self, state_bytes: int) -> Optional[str]:
        """Room for this node's snapshots: every local rank's own copy and replica, twice (the newest
        complete and the one being written). Returns the problem, or None."""
        copies = 2 if self.peer is not None else 1
        need = 2 * copies * self.local_world_size * state_bytes
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            usage = shutil.disk_usage(self.dir)
        except OSError as exc:
            return f"checkpoint.memory.root: cannot create {self.dir}: {exc}"
        held = sum(p.stat().st_size for p in self.dir.rglob("*.snap") if p.is_file())
        free = usage.free + held  # what this run holds now is replaced, not added to
        if free >= need:
            return None
        return (f"the memory tier needs {_size(need)} in {self.dir} ({self.local_world_size} ranks on this "
                f"node x {_size(state_bytes)} of state x {copies} cop{'ies' if copies > 1 else 'y'} "
                f"(own{' + replica' if copies > 1 else ''}) x 2 (newest + being written)), but its file system has "
                f"{_size(free)} free of {_size(usage.total)}. Enlarge it (docker run --shm-size, "
                "or mount -o remount,size=... /dev/shm), point checkpoint.memory.root at a larger tmpfs, or set "
                "checkpoint.memory.required=false to train on the durable tier alone")

    def disable(self) -> None:
        self.enabled = False

    # -- snapshots -------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and self.interval > 0 and step % self.interval == 0

    def set_interval(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"memory snapshot interval {steps} must be >= 1")
        self.interval = int(steps)

    def snapshot(self, step: int, state_dict: Dict[str, Any], manifest: Manifest) -> None:
        """Stage ``state_dict`` (the training thread's only cost) and write and replicate it in the background."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        staged = self.stager.stage(state_dict)
        stall = time.perf_counter() - t0
        info = {"step": step, "owner": self.rank, "world_size": self.world_size, "layout": self.layout,
                "config_hash": self.config_hash, "algorithm": self.algorithm,
                "manifest": json.loads(manifest.to_json())}
        self._in_flight = self._executor.submit(self._persist, step, staged, info, stall, waited)

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

    def _persist(self, step: int, staged: Dict[str, Any], info: dict, stall: float, waited: float) -> SnapshotRecord:
        """Write, exchange, commit; each phase agreed over the group, so a rank that failed (a full
        tmpfs) never leaves its peer waiting in a transfer that will not come."""
        t0 = time.perf_counter()
        d = self.dir / STEP_DIR.format(step)
        replica_bytes, replica_s, replica_info, size = 0, 0.0, None, 0

        def failed() -> SnapshotRecord:
            return SnapshotRecord(step, stall, waited, time.perf_counter() - t0, replica_s, size, replica_bytes, False)

        try:
            d.mkdir(parents=True, exist_ok=True)
            for owner in {self.rank, self.source if self.source is not None else self.rank}:
                (d / f"rank{owner:05d}.json").unlink(missing_ok=True)  # a commit of an earlier try of this step
            own = d / f"rank{self.rank:05d}.snap"
            size, checksum = write_snapshot(own, staged, self.algorithm)
            info.update(size=size, checksum=checksum)
            ok = True
        except Exception as exc:
            log.error("memory snapshot of step %d: writing on rank %d failed: %s: %s", step, self.rank,
                      type(exc).__name__, exc)
            ok = False
        if not self._all(ok):
            return failed()
        if self.peer is not None:
            t1 = time.perf_counter()
            try:
                replica_info = self._exchange(own, info, d)
                replica_bytes, ok = replica_info["size"], True
            except SnapshotError as exc:  # the transfer itself completed on both sides
                log.error("memory snapshot of step %d on rank %d: %s", step, self.rank, exc)
                ok = False
            replica_s = time.perf_counter() - t1
            if not self._all(ok):
                return failed()
        atomic_write_text(d / f"rank{self.rank:05d}.json", json.dumps(info))
        if replica_info is not None:
            atomic_write_text(d / f"rank{replica_info['owner']:05d}.json", json.dumps(replica_info))
        if self._all(True):  # every rank committed step: the older ones can go
            self._drop_older(step)
        return SnapshotRecord(step, stall, waited, time.perf_counter() - t0, replica_s, size, replica_bytes, True)

    def _exchange(self, own: Path, info: dict, d: Path) -> dict:
        """Send this rank's file to the peer and receive the source's into ``d``; check its checksum.
        The destination is reserved with fallocate first (a write into a mapped file on a full tmpfs
        would kill the process with SIGBUS); if that fails the bytes are received into scratch
        memory, so the sender is not left hanging, and the failure is raised afterwards."""
        payload = torch.from_file(str(own), shared=False, size=info["size"], dtype=torch.uint8)
        info_out = torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)
        header_out = torch.tensor([info["size"], info_out.numel()], dtype=torch.int64)
        header_in = torch.empty(2, dtype=torch.int64)
        _wait([dist.isend(header_out, self.peer, group=self.group, tag=_TAG_HEADER),
               dist.irecv(header_in, self.source, group=self.group, tag=_TAG_HEADER)])
        size_in, info_len = int(header_in[0]), int(header_in[1])
        info_in = torch.empty(info_len, dtype=torch.uint8)
        replica_tmp = d / f"replica-from-{self.source:05d}.tmp"
        no_room: Optional[OSError] = None
        try:
            fd = os.open(replica_tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size_in)
            finally:
                os.close(fd)
            incoming = torch.from_file(str(replica_tmp), shared=True, size=size_in, dtype=torch.uint8)
        except OSError as exc:
            no_room, incoming = exc, torch.empty(size_in, dtype=torch.uint8)
            replica_tmp.unlink(missing_ok=True)
        _wait([dist.isend(info_out, self.peer, group=self.group, tag=_TAG_INFO),
               dist.isend(payload, self.peer, group=self.group, tag=_TAG_DATA),
               dist.irecv(info_in, self.source, group=self.group, tag=_TAG_INFO),
               dist.irecv(incoming, self.source, group=self.group, tag=_TAG_DATA)])
        del payload
        received = json.loads(info_in.numpy().tobytes())
        if no_room is not None:
            raise SnapshotError(f"no room for the replica of rank {received['owner']} ({_size(size_in)}) in {d}: "
                                f"{no_room}")
        got = checksum_buffer(incoming.numpy(), received["algorithm"])
        del incoming
        if got != received["checksum"] or received["size"] != size_in:
            raise SnapshotError(f"replica of rank {received['owner']} step {received['step']} arrived damaged "
                                f"(checksum {got} != {received['checksum']})")
        os.replace(replica_tmp, d / f"rank{received['owner']:05d}.snap")
        return received

    def _drop_older(self, step: int) -> None:
        for d in self.dir.glob("step_*"):
            try:
                if int(d.name.split("_")[1]) < step:
                    shutil.rmtree(d, ignore_errors=True)
            except ValueError:
                continue

    def _all(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank (over the tier's group)."""
        if self.group is None:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item()) == 0

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.stager.close()

    def discard(self) -> None:
        """Delete this node's snapshots (the run finished: they would only hold memory)."""
        self.wait()
        for d in self.dir.glob("step_*"):
            shutil.rmtree(d, ignore_errors=True)

    # -- restore ---------------------------------------------------------------------------
    def _held(self) -> List[dict]:
        """The committed copies in this node's directory (any owner)."""
        out = []
        for meta in sorted(self.dir.glob("step_*/rank*.json")):
            try:
                info = json.loads(meta.read_text())
                info["path"] = str(meta.with_suffix(".snap"))
                out.append(info)
            except (OSError, ValueError) as exc:
                log.warning("memory tier: unreadable copy manifest %s (%s): ignored", meta, exc)
        return out

    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def restore(self, state, newer_than: int = 0) -> Optional[Restored]:
        """Restore ``state`` from the newest step every rank can get an intact copy of (and newer
        than ``newer_than``, the newest durable checkpoint). None: nothing usable, nothing touched."""
        t0 = time.perf_counter()
        held = self._held()
        everyone = self._gather([{k: v for k, v in h.items() if k != "manifest"} | {"holder": self.rank}
                                 for h in held])
        copies = [c for per_rank in everyone for c in per_rank]
        if not copies:
            return None
        usable = [c for c in copies if c["world_size"] == self.world_size and c["layout"] == self.layout]
        if not usable:
            c = copies[0]
            if self.rank == 0:
                log.warning("memory tier: the snapshots in memory were taken at world %d, layout %s; this run has "
                            "world %d, layout %s: they are ignored, resuming from the durable tier", c["world_size"],
                            c["layout"], self.world_size, self.layout)
            return None
        for step in sorted({c["step"] for c in usable}, reverse=True):
            if step <= newer_than:
                if self.rank == 0:
                    log.info("memory tier: the newest snapshot (step %d) is not newer than the durable checkpoint of "
                             "step %d: resuming from the durable tier", step, newer_than)
                return None
            at_step = [c for c in usable if c["step"] == step]
            if {c["owner"] for c in at_step} != set(range(self.world_size)):
                continue
            restored = self._restore_step(state, step, at_step, [h for h in held if h["step"] == step], t0)
            if restored is not None:
                return restored
        if self.rank == 0:
            log.warning("memory tier: no step has an intact copy for every rank: resuming from the durable tier")
        return None

    def _restore_step(self, state, step: int, at_step: List[dict], mine: List[dict], t0: float) -> Optional[Restored]:
        t1 = time.perf_counter()
        own, own_buf = next((h for h in mine if h["owner"] == self.rank), None), None
        if own is not None:  # this rank's own copy is verified here; a replica by its receiver, on arrival
            try:
                data = torch.from_file(own["path"], shared=False, size=own["size"], dtype=torch.uint8)
                if checksum_buffer(data.numpy(), own["algorithm"]) == own["checksum"]:
                    own_buf = data
                else:
                    log.error("memory tier: the copy of rank %d step %d in %s fails its checksum", self.rank, step,
                              own["path"])
            except (OSError, RuntimeError) as exc:
                log.error("memory tier: the copy of rank %d step %d is unreadable: %s", self.rank, step, exc)
        verify_s = time.perf_counter() - t1
        own_intact = self._gather(own_buf is not None)
        sources: Dict[int, Optional[int]] = {}
        for r in range(self.world_size):
            others = sorted(c["holder"] for c in at_step if c["owner"] == r and c["holder"] != r)
            sources[r] = r if own_intact[r] else (others[0] if others else None)
        missing = [r for r, h in sources.items() if h is None]
        if missing:
            if self.rank == 0:
                log.warning("memory tier: step %d has no intact copy for rank(s) %s", step, missing)
            return None
        t2 = time.perf_counter()
        buf, problem, manifest_json = None, None, None
        for r in range(self.world_size):  # one transfer at a time, in rank order: every rank agrees on it
            h = sources[r]
            if h == r:
                if r == self.rank:
                    buf, manifest_json = own_buf, own.get("manifest")
            elif self.rank == h:
                self._send_copy(next(x for x in mine if x["owner"] == r), r)
            elif self.rank == r:
                buf, manifest_json, problem = self._receive_copy(h)
        read_s = time.perf_counter() - t2
        manifest = None
        t3 = time.perf_counter()
        if problem is None:
            try:
                manifest = Manifest.from_json(json.dumps(manifest_json))
                apply_snapshot(state, buf)
            except Exception as exc:  # noqa: BLE001 - a copy that does not apply is a problem to agree on
                problem = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        apply_s = time.perf_counter() - t3
        names = {r: "local" if h == r else "peer" for r, h in sources.items()}
        timings = {"verify_s": round(verify_s, 3), "read_s": round(read_s, 3), "apply_s": round(apply_s, 3),
                   "total_s": round(time.perf_counter() - t0, 3)}
        return Restored(step, manifest, names, problem, timings)

    def _send_copy(self, copy: dict, to: int) -> None:
        """Stream one held copy to rank ``to``: header (size, manifest length), manifest, bytes. A copy
        that cannot be read is announced with size -1 so the receiver does not wait for it."""
        try:
            data = torch.from_file(copy["path"], shared=False, size=copy["size"], dtype=torch.uint8)
            meta = torch.frombuffer(bytearray(json.dumps(copy).encode()), dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            log.error("memory tier: cannot read the copy of rank %d for sending: %s", to, exc)
            dist.send(torch.tensor([-1, 0], dtype=torch.int64), to, group=self.group, tag=_TAG_HEADER)
            return
        dist.send(torch.tensor([copy["size"], meta.numel()], dtype=torch.int64), to, group=self.group,
                  tag=_TAG_HEADER)
        dist.send(meta, to, group=self.group, tag=_TAG_INFO)
        dist.send(data, to, group=self.group, tag=_TAG_DATA)

    def _receive_copy(self, holder: int):
        """(bytes, its manifest, problem) of this rank's copy streamed from ``holder``."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, holder, group=self.group, tag=_TAG_HEADER)
        size, meta_len = int(header[0]), int(header[1])
        if size < 0:
            return None, None, f"rank {self.rank}: the peer rank {holder} could not read its replica"
        meta = torch.empty(meta_len, dtype=torch.uint8)
        dist.recv(meta, holder, group=self.group, tag=_TAG_INFO)
        buf = torch.empty(size, dtype=torch.uint8)
        dist.recv(buf, holder, group=self.group, tag=_TAG_DATA)
        copy = json.loads(meta.numpy().tobytes())
        if checksum_buffer(buf.numpy(), copy["algorithm"]) != copy["checksum"]:
            return None, None, f"rank {self.rank}: the replica streamed from rank {holder} arrived damaged"
        return buf, copy.get("manifest"), None

    def forget(self, step: int) -> None:
        """Drop this node's copies of ``step`` (it failed to restore): the next restart does not retry it."""
        shutil.rmtree(self.dir / STEP_DIR.format(step), ignore_errors=True)

    def agree(self, problem: Optional[str]) -> Optional[str]:
        """Every rank's problems, joined, if any rank has one (else None)."""
        problems = self._gather(problem)
        found = [p for p in problems if p]
        return "; ".join(found) if found else None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _wait(works: list) -> None:
    for w in works:
        w.wait()
