"""A save that the storage refused (disk full, read-only, over quota): one message that says what
happened, with the numbers, and what to do.

The saver (checkpoint/durable/saver.py) removes the uncommitted directory and raises
``CheckpointSaveError`` on every rank; the manager (checkpoint/manager.py) stops the run with
it (``checkpoint.on_save_error=stop``) or records it as an alarm and trains on
(``continue``). Committed checkpoints are never touched: nothing is deleted to make room.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from checkpoint.durable.discovery import latest_committed, remove_checkpoint
from checkpoint.durable.manifest import CheckpointError
from checkpoint.storage import location

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


def describe_save_failure(step: int, root: Path, staging: Path, errors: Iterable[str], errno_: Optional[int],
                          expected_bytes: Optional[int], newest_committed: Optional[str],
                          removed: Optional[bool] | str = True, listed: bool = True) -> str:
    """The message: which save, where, why (per rank), free bytes, checkpoint size, what to do.
    ``removed``: whether this process removed the uncommitted folder (None: another rank's job; "never": the
    save failed before it chose one);
    ``listed``: whether the committed checkpoints could be listed (a store that stopped answering
    answers neither)."""
    root = location(root)
    try:
        free: Optional[int] = root.free_bytes()
    except OSError:
        free = None
    reason, fix = _REASONS.get(errno_, ("the storage refused the write", "check the file system"))
    if errno_ not in _REASONS and root.failure_hint() is not None:
        reason, fix = root.failure_hint()
    errors = list(errors)
    detail = "; ".join(errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
    kept = (f"the newest committed checkpoint, {newest_committed}, is intact" if newest_committed
            else "there is no committed checkpoint yet" if listed
            else "the committed checkpoints could not be listed, the storage did not answer; none was written to")
    gone = {True: "removed", None: "removed by rank 0, or at the next start",
            False: "not removed, the storage did not answer: the next start removes it",
            "never": "none made: the storage failed before the save chose its folder"}[removed]
    return (f"checkpoint of step {step} could not be saved: {reason}. {detail}.\n"
            f"  directory: {staging} ({gone}; nothing committed was touched: {kept})\n"
            f"  free in {root}: {_bytes(free)}; one checkpoint of this run: {_bytes(expected_bytes)}; while a "
            "save is written the directory holds checkpoint.keep_last + 1 of them\n"
            f"  what to do: {fix}, or lower checkpoint.keep_last; then relaunch: the run resumes from the newest "
            "committed checkpoint. checkpoint.on_save_error=continue trains on when a save fails (an alarm in "
            "metrics.jsonl; the next interval tries again).")


def refused_save(exc: BaseException, code: int, step: int, root: Path, staging: Path, rank: int,
                 expected_bytes: Optional[int], coordinator: bool) -> CheckpointSaveError:
    """The CheckpointSaveError of a save the storage refused (``code``, from ``exc``), on every rank:
    the coordinator removes the uncommitted directory first; each rank lists the newest committed
    checkpoint for the message (nothing else depends on it)."""
    removed = None  # the coordinator's job
    if staging is None:  # failed before a folder was chosen: nothing to remove
        removed, staging = "never", location(root)
    elif coordinator:
        try:
            remove_checkpoint(staging)
            removed = True
        except FileNotFoundError:  # never created
            removed = True
        except OSError:
            removed = False  # removed at the next start
    try:
        newest, listed = latest_committed(root), True
    except (OSError, CheckpointError):  # the storage that failed the save may not answer a listing either
        newest, listed = None, False
    errors = [f"rank {r}: {e}" for r, e in rank_errors(exc, rank)]
    message = describe_save_failure(step, root, staging, errors, code, expected_bytes,
                                    newest.checkpoint_id if newest else None, removed, listed)
    err = CheckpointSaveError(message, step, code)
    err.__cause__ = exc
    return err
