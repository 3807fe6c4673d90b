"""The data position a checkpoint stores, and the checks made when a run resumes from it.

The state is a few numbers, the same on every rank: where the run is (``step``,
``samples_consumed``), what that position means (``seed``, ``global_batch_size``,
``seq_len``, ``fingerprint`` of the data and mixture) and, for people reading it, the
``epoch``. Nothing in it depends on the number of ranks or dataloader workers, so a run
resumes on any dp size and any ``num_workers``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Collection, Dict, List

from data.prepared import DataError

STATE_VERSION = 1
# Fields that give samples a different meaning when they change: refused unless allowed.
MEANING_FIELDS = ("fingerprint", "seed", "seq_len", "global_batch_size")


class DataResumeError(DataError):
    """The checkpoint's data state does not fit this run's data configuration."""


@dataclass
class DataState:
    step: int  # optimizer steps taken (batches handed to the trainer)
    samples_consumed: int  # global samples in those steps: the next batch starts here
    epoch: int  # full passes completed over every source (min over sources); informational
    seed: int
    global_batch_size: int
    seq_len: int
    fingerprint: str  # data/order.py dataset_fingerprint: shards' sha256 + mixture quotas
    version: int = STATE_VERSION

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Dict[str, object]) -> "DataState":
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in state]
        if missing:
            raise DataResumeError(f"the checkpoint's data state lacks {missing} (it has {sorted(state)})")
        values = {n: _plain(state[n]) for n in names}
        if values["version"] != STATE_VERSION:
            raise DataResumeError(f"data state version {values['version']}; this code reads version {STATE_VERSION}")
        return cls(**values)


def _plain(value):
    """DCP may hand back 0-d tensors or bytes for what was saved as int / str."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode()
    return value


def resume_changes(saved: DataState, current: DataState) -> List[str]:
    """What differs between the checkpoint's data meaning and this run's, in words."""
    changes = []
    for name in MEANING_FIELDS:
        before, now = getattr(saved, name), getattr(current, name)
        if before != now:
            changes.append(f"{name}: checkpoint {before!r} -> this run {now!r}")
    return changes


def check_resume(saved: DataState, current: DataState, allowed: Collection[str] = ()) -> List[str]:
    """Refuse a resume whose samples would mean something else, unless that change is allowed.

    ``allowed`` names fields of MEANING_FIELDS that may change (data.allow_resume_changes
    allows all of them). Returns the changes, in words, for the log.
    """
    changes = resume_changes(saved, current)
    refused = [c for c in changes if c.split(":")[0] not in allowed]
    if refused:
        raise DataResumeError(
            "refusing to resume: the data would not continue the checkpoint's sample order. Changed: "
            + "; ".join(refused)
            + ". Restore the original data/seed/training.seq_len/training.global_batch_size, or set "
            "data.allow_resume_changes=true to continue from global sample "
            f"{saved.samples_consumed} of the new order anyway."
        )
    return changes
