"""The memory tier: frequent snapshots in node-local shared memory, each replicated to a peer node.

A durable checkpoint goes to shared storage at the Young/Daly interval; a failure then costs
half an interval of work plus a reload from storage. The memory tier (checkpoint.memory) keeps
a snapshot every few steps in a tmpfs directory (``/dev/shm`` by default), which outlives a
worker restart by torchrun, and with ``replicas: 1`` sends the same bytes to the rank
``local_world_size`` away: the same local rank on the next node, a ring over nodes. A worker
crash restores from its own node's copy, a lost node from its peer's replica, and neither
reads storage. The durable tier keeps running at its own interval.

This module is the tier's face: its schedule, the pre-flight, and a snapshot's training-thread
half (wait for the previous snapshot, at most one in flight; copy the state into one reused flat
host buffer, snapshot.FlatStager; return to training). The parts:
  snapshot.py    one rank's state as one checksummed file (the format)
  commit.py      the background half: write, replicate, two-round commit, drop older steps
  transport.py   the tier's gloo group: agreements, the replica exchange, copies sent to a peer
  restore.py     the newest step every rank can get an intact copy of, local or from a peer

Node identity: one tmpfs per host, so by default the directory is ``root`` itself. On a
machine that plays several nodes (tests: two torchrun agents on one host)
``checkpoint.memory.node`` gives each its own ``root/node-<id>``.
"""

from __future__ import annotations

import getpass
import json
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from checkpoint.durable.manifest import Manifest
from checkpoint.memory.commit import SnapshotRecord, persist
from checkpoint.memory.restore import Restored, restore
from checkpoint.memory.snapshot import STEP_DIR, FlatStager
from checkpoint.memory.transport import PeerGroup, size_text

log = logging.getLogger("trainer")


def default_root(run_name: str) -> Path:
    """Node-local shared memory, one directory per user and run."""
    return Path("/dev/shm") / getpass.getuser() / run_name


class MemoryTier:
    def __init__(self, mcfg, *, run_name: str, rank: int, world_size: int, local_world_size: int,
                 layout: Dict[str, int], config_hash: str, algorithm: str, pin_memory: bool = False,
                 timeout_s: float = 600.0, fault_hook: Optional[Callable[..., None]] = None):
        self.cfg = mcfg
        root = Path(mcfg.root) if mcfg.root else default_root(run_name)
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
    def preflight(self, state_bytes: int) -> Optional[str]:
        """Room for this node's snapshots: every local rank's own copy and replica, twice (the newest
        complete and the one being written). Returns the problem, or None."""
        copies = 2 if self.peers.peer is not None else 1
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
        return (f"the memory tier needs {size_text(need)} in {self.dir} ({self.local_world_size} ranks on this "
                f"node x {size_text(state_bytes)} of state x {copies} cop{'ies' if copies > 1 else 'y'} "
                f"(own{' + replica' if copies > 1 else ''}) x 2 (newest + being written)), but its file system has "
                f"{size_text(free)} free of {size_text(usage.total)}. Enlarge it (docker run --shm-size, "
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

    def snapshot(self, step: int, state_dict: Dict[str, Any], manifest: Manifest,
                 started: Optional[float] = None) -> None:
        """Stage ``state_dict`` (the training thread's only cost) and write and replicate it in the
        background. ``started``: when the snapshot began (before its manifest was built), for its stall.
        The manifest has no probe loss: the restore compares the applied bytes (restore.py)."""
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
        for d in self.dir.glob("step_*"):
            shutil.rmtree(d, ignore_errors=True)

    # -- restore ---------------------------------------------------------------------------
    def restore(self, state, newer_than: int = 0, allow_config_change: bool = False) -> Optional[Restored]:
        """Restore ``state`` from the newest step every rank can get an intact copy of (and newer
        than ``newer_than``, the newest durable checkpoint). None: nothing usable, nothing touched.
        ConfigMismatch: taken with another config (checkpoint/memory/restore.py)."""
        return restore(self, state, newer_than, allow_config_change)

    def forget_newer(self, step: int) -> None:
        """Drop this node's copies of every step after ``step``: a resume went back past them."""
        for d in self.dir.glob("step_*"):
            if d.name.split("_")[-1].isdigit() and int(d.name.split("_")[-1]) > step:
                shutil.rmtree(d, ignore_errors=True)

    def forget(self, step: int) -> None:
        """Drop this node's copies of ``step`` (it failed to restore): the next restart does not retry it."""
        shutil.rmtree(self.dir / STEP_DIR.format(step), ignore_errors=True)

    def agree(self, problem: Optional[str]) -> Optional[str]:
        """Every rank's problems, joined, if any rank has one (else None)."""
        return self.peers.agree(problem)
