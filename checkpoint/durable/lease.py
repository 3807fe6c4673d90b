"""Which attempt owns a checkpoint directory: a writer never commits into one a newer attempt owns.

An attempt is one start of the run. Its coordinator creates ``attempts/attempt_<K>`` for the next free K,
only if absent, so two attempts starting at once never share a number; the highest K owns the directory.
Every rank checks the lease before it acknowledges its files, the coordinator again before the commit and
before it moves ``latest``: a writer left over from an older attempt stops with ``StaleWriter``. It is a
check, not a lock; that workers die with their launcher (parallel/init.py) closes the window.

The owner's record is its heartbeat (``Heartbeat`` rewrites it every ``timeout / 4`` s, and marks it
released when the run closes). A launch that finds the owner live (its record younger than
``checkpoint.lease_timeout_s``, not released, not a dead pid on this host, not this torchrun job's) refuses
with ``LiveOwner`` before anything is written, unless ``checkpoint.take_over=true``.

Replica groups (parallel.fault_tolerance) share one checkpoint.dir, and each group is its own torchrun job that
restarts alone: each holds a lease of its own, ``replica_groups/group_<G>/attempts`` (``group_lease``). A
restarted group's new attempt makes its own older writer stale, never another group's, whose saves are
legitimate (the quorum says which group writes each step: recovery/fault_tolerance.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import List, Optional

from checkpoint.durable.manifest import CheckpointError
from checkpoint.storage import location

log = logging.getLogger("trainer")

ATTEMPTS = "attempts"
GROUPS = "replica_groups"  # a replica group's lease: GROUPS/group_<G>/ATTEMPTS
_PREFIX = "attempt_"
RELEASED = ".released"  # beside an attempt's record: its run closed (a later launch need not wait)
KEEP_RECORDS = 8  # older attempt records are pruned; the highest number is all that matters


class StaleWriter(CheckpointError):
    """This process belongs to an older attempt: a newer one owns the checkpoint directory."""


class LiveOwner(CheckpointError):
    """A live attempt owns the checkpoint directory: this launch is refused and changes nothing there."""


def group_lease(root, group: int):
    """The location whose ``attempts`` hold replica group ``group``'s lease on checkpoint.dir ``root``: a launch
    of the same group is refused while it lives (two launches of one group), the other groups are not."""
    return location(root) / GROUPS / f"group_{group}"


def _is_group_lease(root) -> bool:
    return location(root).parent.name == GROUPS


def _numbers(root: Path) -> List[int]:
    d = location(root) / ATTEMPTS
    if not d.is_dir():
        return []
    return sorted(int(p.name[len(_PREFIX):]) for p in d.iterdir()
                  if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit())


def current_attempt(root: Path) -> Optional[int]:
    """The attempt that owns ``root`` now (None before the first attempt took it)."""
    found = _numbers(root)
    return found[-1] if found else None


def describe(root: Path, attempt: int) -> str:
    """``attempt K (pid P on HOST, started T)`` from its record, for messages."""
    try:
        rec = json.loads(_record_path(root, attempt).read_text())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["started_at"]))
        return f"attempt {attempt} (pid {rec['pid']} on {rec['host']}, started {when})"
    except (OSError, ValueError, KeyError):
        return f"attempt {attempt}"


def _record_path(root: Path, attempt: int, suffix: str = "") -> Path:
    return location(root) / ATTEMPTS / f"{_PREFIX}{attempt:06d}{suffix}"


def _pid_gone(pid: int) -> bool:
    """No process ``pid`` on this host, or only its zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def job_id() -> Optional[str]:
    """The torchrun job this process belongs to (TORCHELASTIC_RUN_ID, torchrun's ``--rdzv-id``), or None.
    ``none`` is torchrun's default for a multi-node static rendezvous without an id: every such job
    has it, so it names no job (two unrelated launches must not count as one)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    return run_id if run_id and run_id.lower() != "none" else None


def live_owner(root: Path, timeout_s: float) -> Optional[str]:
    """The message for a launch into ``root`` while its owner is live (None: no live owner). Read-only."""
    owner = current_attempt(root)
    if owner is None:
        return None
    path = _record_path(root, owner)
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return None
    if _record_path(root, owner, RELEASED).exists() or age >= timeout_s or _known_gone(path):
        return None
    return (f"{root} is in use by a live run: {describe(root, owner)}, heartbeat {age:.0f} s ago (a run is live while "
            f"its heartbeat is younger than checkpoint.lease_timeout_s={timeout_s:g}). Nothing was changed. Wait "
            "for it to finish, give this launch another run_name (or checkpoint.dir), or, if that run is really "
            "gone (a job on a node that cannot be reached), take over with checkpoint.take_over=true")


def earlier_writers_may_live(root: Path, attempt: Optional[int]) -> bool:
    """Whether a writer of an attempt older than ``attempt`` may still be writing into ``root`` (start-up
    clean-up then spares what it may be writing): not when each older record kept is released, a dead pid on
    this host, or this torchrun job's (restarted workers: torchrun stopped the old ones). A taken-over owner or
    one whose heartbeat merely went silent may live. ``attempt`` None (no lease held): False. A replica group's
    lease (``group_lease``): True, the other groups' writers may be saving now."""
    if attempt is None:
        return False
    if _is_group_lease(root):
        return True
    return any(not _record_path(root, n, RELEASED).exists() and not _known_gone(_record_path(root, n))
               for n in _numbers(root) if n < attempt)


def _known_gone(path: Path) -> bool:
    """Whether the writer of the lease record at ``path`` is known to have stopped: its pid died on this host
    (no need to wait for the timeout), or it was this torchrun job's (workers restarted, or a requeue of the
    job: the launcher stopped the old ones). A record that does not read (created a moment ago, not yet
    written) proves nothing."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if record.get("host") == socket.gethostname() and _pid_gone(int(record.get("pid", 0))):
        return True
    run_id = job_id()
    return bool(run_id) and record.get("run_id") == run_id


def newer_owner(root: Path, attempt: Optional[int]) -> Optional[str]:
    """The message of the StaleWriter to raise if an attempt newer than ``attempt`` owns ``root`` (after a
    failed save); None if not, or if the lease cannot be read (that proves nothing)."""
    try:
        check_lease(root, attempt)
    except StaleWriter as stale:
        return str(stale)
    except Exception:  # noqa: BLE001 - the storage that failed the save may not answer either
        pass
    return None


def take_lease(root: Path, timeout_s: Optional[float] = None, take_over: bool = False) -> int:
    """Become the owner of ``root`` (the coordinator of a new attempt calls it once); returns the
    attempt number every rank of this attempt then checks with ``check_lease``. With ``timeout_s``,
    raise LiveOwner while the owner is live (unless ``take_over``)."""
    (location(root) / ATTEMPTS).mkdir(parents=True, exist_ok=True)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                         "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                         "run_id": job_id()})
    while True:
        problem = live_owner(root, timeout_s) if timeout_s is not None else None
        if problem is not None and not take_over:
            raise LiveOwner(problem)
        if problem is not None:
            log.warning("checkpoint.take_over=true: taking over although %s", problem.split(". Nothing")[0])
        attempt = (current_attempt(root) or 0) + 1
        try:
            _record_path(root, attempt).create_bytes(record.encode())
        except FileExistsError:  # another attempt took this number first: take the next one
            continue
        break
    for old in _numbers(root)[:-KEEP_RECORDS]:
        _record_path(root, old).unlink(missing_ok=True)
        _record_path(root, old, RELEASED).unlink(missing_ok=True)
    return attempt


class Heartbeat:
    """The owner's heartbeat: rewrites its attempt record every ``timeout_s / 4`` from a thread (its
    modification time is the beat), so it beats through long steps and saves in flight alike; ``stop``
    marks the lease released (a later launch need not wait)."""

    def __init__(self, root: Path, attempt: int, timeout_s: float):
        self.path, self._stop = _record_path(root, attempt), threading.Event()
        self._record: Optional[bytes] = None  # read at the first beat, written again at each
        self._thread = threading.Thread(target=self._beat, args=(timeout_s / 4,), name="lease-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self._record = self._record if self._record is not None else self.path.read_bytes()
                self.path.write_bytes(self._record)
            except OSError:  # pruned by a newer attempt, or the storage hiccuped: the next beat retries
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            if self.path.is_file():
                self.path.with_name(self.path.name + RELEASED).write_bytes(b"")
        except OSError:
            pass


def check_lease(root: Path, attempt: Optional[int]) -> None:
    """Raise StaleWriter if an attempt newer than ``attempt`` owns ``root`` (None: no lease held,
    nothing checked; tools and tests that drive a saver by hand)."""
    if attempt is None:
        return
    owner = current_attempt(root)
    if owner is not None and owner != attempt:
        raise StaleWriter(
            f"{root} is owned by {describe(root, owner)}; this process ({describe(root, attempt)}, pid "
            f"{os.getpid()}) is a leftover of an older attempt and stops without committing. Nothing was "
            "overwritten. If you started two runs on one checkpoint.dir by mistake, give each its own run_name.")
