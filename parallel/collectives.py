"""Rank agreement: the small collectives through which ranks make one decision together.

A choice that decides which collectives a rank runs next (load this checkpoint or that one, stop
or go on) must be the same on every rank, or the ranks pair different collectives and hang.
These helpers make it so: one rank decides and tells the others (``decided_on_rank0``), or every
rank votes and all get the same verdict (``any_rank``). Without a process group each is the
identity, so single-process code calls them unconditionally.
"""

from __future__ import annotations

from typing import Callable, Tuple, Type, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def any_rank(flag: bool, device: torch.device = torch.device("cpu")) -> bool:
    """True on every rank if ``flag`` is true on any rank (``flag`` itself without a process group)."""
    if not distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def decided_on_rank0(decide: Callable[[], T], errors: Tuple[Type[Exception], ...] = ()) -> T:
    """Run ``decide`` on rank 0 only and give every rank its (picklable) answer. An exception of one
    of the ``errors`` types that it raises is raised on every rank, with the same type and message;
    any other exception propagates on rank 0 alone, as it would without this helper."""
    outcome: list = [None, None]  # (answer, (index into errors, message) of what decide raised)
    if not distributed() or dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except errors as exc:
            outcome[1] = (next(i for i, e in enumerate(errors) if isinstance(exc, e)), str(exc))
    if distributed():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise errors[outcome[1][0]](outcome[1][1])
    return outcome[0]
