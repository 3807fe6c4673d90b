"""Which attempt owns a checkpoint directory: a writer never commits into one a newer attempt owns.

An attempt is one start of the run (a torchrun restart, a scheduler requeue, a relaunch by
hand). Its coordinator takes the lease at start-up, before it resumes: it creates
``attempts/attempt_<K>`` with ``O_CREAT | O_EXCL`` for the next free K, so two attempts
starting at once never get the same number. The highest K owns the directory. Every rank
checks the lease before it acknowledges its files and the coordinator checks it again right
before the commit rename and before it moves ``latest``, so a writer left over from an older
attempt (an orphaned worker, a job the scheduler believes dead) stops with ``StaleWriter``
instead of committing over the newer attempt's checkpoints.

It is a check, not a lock: the window between the last check and the rename is one system
call. What closes the rest is that workers die with their launcher (``die_with_launcher`` in
parallel/init.py).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import List, Optional

from checkpoint.durable.integrity import fsync_dir
from checkpoint.durable.manifest import CheckpointError

ATTEMPTS = "attempts"
_PREFIX = "attempt_"
KEEP_RECORDS = 8  # older attempt records are pruned; the highest number is all that matters


class StaleWriter(CheckpointError):
    """This process belongs to an older attempt: a newer one owns the checkpoint directory."""


def _numbers(root: Path) -> List[int]:
    d = Path(root) / ATTEMPTS
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
        rec = json.loads((Path(root) / ATTEMPTS / f"{_PREFIX}{attempt:06d}").read_text())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["started_at"]))
        return f"attempt {attempt} (pid {rec['pid']} on {rec['host']}, started {when})"
    except (OSError, ValueError, KeyError):
        return f"attempt {attempt}"


def take_lease(root: Path) -> int:
    """Become the owner of ``root`` (the coordinator of a new attempt calls it once); returns the
    attempt number every rank of this attempt then checks with ``check_lease``."""
    d = Path(root) / ATTEMPTS
    d.mkdir(parents=True, exist_ok=True)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                         "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
    while True:
        attempt = (current_attempt(root) or 0) + 1
        try:
            fd = os.open(d / f"{_PREFIX}{attempt:06d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another attempt took this number first: take the next one
            continue
        try:
            os.write(fd, record.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(d)
        break
    for old in _numbers(root)[:-KEEP_RECORDS]:
        (d / f"{_PREFIX}{old:06d}").unlink(missing_ok=True)
    return attempt


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
