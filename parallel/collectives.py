"""Every collective the product's own code issues (not FSDP's, DTensor's or DCP's), in one place.

Two kinds of traffic, two kinds of group:
- **Tensors of the model** (token counts, loss sums, gradient norms with the step's flags that ride
  in their vector, weight fingerprints) live on the training device and go to a training group
  (the default group or a mesh group): ``all_reduce``, ``all_reduce_coalesced`` (many tensors, one
  message), ``all_gather``. On CUDA those groups are NCCL, which takes CUDA tensors only.
- **Control values** (other flags, timings, verdicts, picklable answers) live on the host and go to the
  *control group*, a gloo group over every rank (``init_control_group``; on a CPU run, where the
  default group is gloo already, it is the default group): ``agree_max``, ``any_rank``,
  ``gather_floats``, ``broadcast_object``, ``decided_on_rank0``, ``all_gather_object``, ``barrier``.
  A caller with a gloo group of its own (the checkpoint writer, the memory tier) passes it.

Each helper checks that the group's backend takes the tensor's device before sending
(``check_device``): a CPU tensor on an NCCL group fails here with the group and the fix, not as
"No backend type associated with device type cpu" deep inside a 512-rank job. gloo takes every
device, so CPU tests cannot see that rule; tests/unit/test_collectives.py checks it with stand-in
groups, and fails on any torch.distributed collective called elsewhere.

Agreement: a choice that decides which collectives a rank runs next (load this checkpoint or that
one, roll back or go on, save at this step) must be the same on every rank, or the ranks pair
different collectives and hang. One rank decides and tells the others (``decided_on_rank0``), or
every rank votes (``any_rank``, ``agree_max``). Without a process group every helper is the
identity, so single-process code calls them unconditionally. While rank 0 works for every rank
(``decided_on_rank0``'s decision, retention), the others wait in short agreed polls
(``wait_for_rank0``), never in one collective that the work could outlast.
"""

from __future__ import annotations

import datetime
import threading
from concurrent import futures
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)
DEFAULT_TIMEOUT_S = 1800.0  # torch's default for a process group
_control: Optional[dist.ProcessGroup] = None  # set by init_control_group
_devices: Dict[int, frozenset] = {}  # id(group) -> device types its backends take


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if distributed() else 1


# -- groups -----------------------------------------------------------------------------------
def new_gloo_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over every rank (every rank must call it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def init_control_group(timeout_s: float) -> Optional[dist.ProcessGroup]:
    """Make the control group once, right after the default group (every rank calls it)."""
    global _control
    if not distributed():
        return None
    if _control is None:
        _control = dist.group.WORLD if "cpu" in _device_types(dist.group.WORLD) else new_gloo_group(timeout_s)
    return _control


def control_group() -> Optional[dist.ProcessGroup]:
    """The gloo group control values travel on. Made on first use if start-up did not make it:
    every rank reaches its first control collective at the same point, so all make it there."""
    if _control is None and distributed():
        init_control_group(DEFAULT_TIMEOUT_S)
    return _control


def forget_groups() -> None:
    """After destroy_process_group: the next process group gets a new control group."""
    global _control
    _control = None
    _devices.clear()


def _device_types(group: Optional[dist.ProcessGroup]) -> frozenset:
    group = group if group is not None else dist.group.WORLD
    key = id(group)
    if key not in _devices:
        config = dist.get_backend_config(group)  # "cuda:nccl", "cpu:gloo,cuda:gloo", ...
        _devices[key] = frozenset(part.split(":")[0] for part in config.split(",") if ":" in part) or \
            frozenset(dist.Backend.backend_capability.get(config, []))
    return _devices[key]


def check_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Raise before sending ``tensor`` to a group whose backend does not take its device."""
    takes = _device_types(group)
    if tensor.device.type not in takes:
        name = "the default group" if group is None or group is dist.group.WORLD else "this group"
        raise RuntimeError(
            f"{what}: a {tensor.device.type} tensor sent to {name} ({dist.get_backend_config(group)}), whose "
            f"backend takes only {sorted(takes)} tensors. Send control values through the control group "
            "(parallel/collectives.py), and model tensors on the training device")


# -- tensors of the model, on a training group ---------------------------------------------------
def all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None, op=None) -> torch.Tensor:
    """In-place sum (or ``op``) over ``group``; the tensor stays on its device."""
    if world(group) > 1:
        check_device(tensor, group, "all_reduce")
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_coalesced(tensors: Sequence[torch.Tensor],
                         group: Optional[dist.ProcessGroup] = None) -> List[torch.Tensor]:
    """The sum of each tensor over ``group``, all of them in one all_reduce: flattened into one buffer
    (one dtype, one device), summed in place, returned as views of it (the inputs are left alone)."""
    if world(group) == 1 or not tensors:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    check_device(flat, group, "all_reduce_coalesced")
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def all_gather(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (same shape), in rank order of ``group``."""
    if world(group) == 1:
        return [tensor]
    check_device(tensor, group, "all_gather")
    out = [torch.empty_like(tensor) for _ in range(world(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def all_reduce_across_replicas(tensors: Sequence[torch.Tensor], manager) -> None:
    """The sum of each tensor over the replica groups of a torchft quorum (``manager``: a ``torchft.Manager``;
    recovery/fault_tolerance.py), in place: one message per dtype. A peer lost during it raises nothing here:
    the manager records the error and the step's commit vote fails, so the sums are never used."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    pending = []
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        pending.append((group, flat, manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)))
    for group, flat, work in pending:
        work.wait()
        for t, piece in zip(group, flat.split([t.numel() for t in group])):
            t.copy_(piece.view(t.shape))


def agree_max_across_replicas(values: Sequence[float], manager, device: torch.device) -> Optional[List[float]]:
    """The element-wise maximum of ``values`` over the replica groups of a torchft quorum (``manager``), for a
    decision every group must take alike (recovery/fault_tolerance.py: the guards' verdict, a rollback's target).
    Every rank of every group in the quorum calls it with its group's agreed values; None when a peer was lost
    during it (torchft records the error instead of raising: the result would not be every group's)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    manager.allreduce(t, reduce_op=dist.ReduceOp.MAX).wait()
    if manager.errored() is not None:
        return None
    return [float(v) for v in t.cpu().tolist()]


def gather_across_replicas(value: int, index: int, count: int, manager, device: torch.device) -> Optional[List[int]]:
    """Each replica group's int64 ``value`` in the order of a torchft quorum of ``count`` groups, this group being
    ``index``: one sum of a vector holding each group's value in its own slot (recovery/fault_tolerance.py: the
    weight fingerprints the guards compare across groups). None when a peer was lost during it."""
    slots = torch.zeros(count, dtype=torch.int64, device=device)
    slots[index] = value
    manager.allreduce(slots, reduce_op=dist.ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    return [int(v) for v in slots.cpu().tolist()]


# -- control values, on the control group (or the caller's gloo group) ----------------------------
def _control_or(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    return group if group is not None else control_group()


def agree_max(values: Sequence[float], group: Optional[dist.ProcessGroup] = None,
              dtype: torch.dtype = torch.float64) -> List[float]:
    """The element-wise maximum of ``values`` over the ranks: one small all_reduce on the host."""
    if not distributed():
        return list(values)
    group = _control_or(group)
    if world(group) == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=dtype)
    check_device(t, group, "agree_max")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [v for v in t.tolist()]


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (``flag`` itself without a process group)."""
    return bool(agree_max([1 if flag else 0], group, dtype=torch.int32)[0])


def gather_floats(value: float, group: Optional[dist.ProcessGroup] = None) -> List[float]:
    """Every rank's ``value``, in rank order (a timing, for a report)."""
    if not distributed():
        return [value]
    group = _control_or(group)
    if world(group) == 1:
        return [value]
    t = torch.tensor([value], dtype=torch.float64)
    check_device(t, group, "gather_floats")
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(world(group))]
    dist.all_gather(out, t, group=group)
    return [float(x) for x in out]


def broadcast_object(obj: T, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not distributed() or world(_control_or(group)) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control_or(group))
    return box[0]


def all_gather_object(obj, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's picklable ``obj``, in rank order of ``group``."""
    if not distributed() or world(_control_or(group)) == 1:
        return [obj]
    out: list = [None] * world(_control_or(group))
    dist.all_gather_object(out, obj, group=_control_or(group))
    return out


MAX_RANKS_NAMED = 8  # a problem met by some ranks names the first few (512 rank numbers help nobody)


def problems_by_rank(per_rank: Sequence[Sequence[str]]) -> List[str]:
    """Each rank's problems (``per_rank[r]``: rank r's), each distinct one once in the order first
    seen, naming the ranks that met it unless every rank did. Pure: every rank computes the same."""
    ranks: Dict[str, List[int]] = {}
    for rank, found in enumerate(per_rank):
        for problem in dict.fromkeys(found):  # a rank that met one problem twice counts once
            ranks.setdefault(problem, []).append(rank)
    out = []
    for problem, seen in ranks.items():
        if len(seen) == len(per_rank):
            out.append(problem)
            continue
        named = ", ".join(map(str, seen[:MAX_RANKS_NAMED])) + (", ..." if len(seen) > MAX_RANKS_NAMED else "")
        out.append(f"{problem} (on {len(seen)} of {len(per_rank)} ranks: {named})")
    return out


def agree_on_problems(problem: Optional[str], group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    """Every rank's ``problem`` joined (``problems_by_rank``), on every rank; None on every rank when
    no rank has one."""
    found = problems_by_rank([[p] if p else [] for p in all_gather_object(problem, group)])
    return "; ".join(found) if found else None


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if distributed() and world(_control_or(group)) > 1:
        dist.barrier(group=_control_or(group))


def agreed(exc: E) -> E:
    """Mark ``exc`` as raised alike on every rank (train.py then prints it once, on rank 0)."""
    exc.agreed = True
    return exc


class RankZeroFailed(RuntimeError):
    """What the other ranks raise when rank 0, deciding for every rank, met an error its caller did not list."""


AGREED_POLL_S = 5.0  # while rank 0 works for every rank: the longest any rank sits in one collective


def wait_for_rank0(done: Callable[[float], bool], poll_s: Optional[float] = None) -> None:
    """Every rank returns once rank 0's ``done(timeout_s)`` (called on rank 0 only; it waits at most
    ``timeout_s`` for the work to end) is true. Rank 0's work for every rank (a listing of thousands of
    objects, reads retried with a backoff, retention deleting terabytes) may outlast the collective
    timeout: the ranks agree every ``poll_s`` whether rank 0 is still at it, so none sits in one
    collective longer than that, and a rank that died is still noticed within the timeout (``poll_s``:
    AGREED_POLL_S unless given)."""
    rank0, poll_s = not distributed() or dist.get_rank() == 0, AGREED_POLL_S if poll_s is None else poll_s
    while any_rank(rank0 and not done(poll_s)):
        pass


def _started(work: Callable[[], T]) -> "futures.Future[T]":
    """``work()`` in a daemon thread (one stuck in the storage must not hold the process's exit)."""
    result: futures.Future = futures.Future()

    def run() -> None:
        try:
            result.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result.set_exception(exc)

    threading.Thread(target=run, name="decided-on-rank0", daemon=True).start()
    return result


def decided_on_rank0(decide: Callable[[], T], errors: Tuple[Type[Exception], ...] = ()) -> T:
    """Run ``decide`` on rank 0 only and give every rank its (picklable) answer. An exception of one
    of the ``errors`` types that it raises is raised on every rank, with the same type and message
    (marked ``agreed``). Any other exception is raised as it is on rank 0 and as RankZeroFailed, naming
    it, on every other rank: raised on rank 0 alone, a caller that goes on would leave its peers here.
    With other ranks, rank 0 decides in a thread while every rank polls (``wait_for_rank0``): a decision
    that reads the storage may take longer than the collective timeout."""
    outcome: list = [None, None]  # (answer, (index into errors or None, message) of what decide raised)
    unlisted: Optional[BaseException] = None
    rank0 = not distributed() or dist.get_rank() == 0
    work = _started(decide) if rank0 and distributed() else None
    if distributed():
        wait_for_rank0(lambda timeout_s: not futures.wait([work], timeout_s).not_done)
    if rank0:
        try:
            outcome[0] = decide() if work is None else work.result()
        except errors as exc:
            outcome[1] = (next(i for i, e in enumerate(errors) if isinstance(exc, e)), str(exc))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            unlisted, outcome[1] = exc, (None, f"{type(exc).__name__}: {exc}")
    outcome = broadcast_object(outcome)
    if unlisted is not None:
        raise unlisted
    if outcome[1] is not None:
        index, message = outcome[1]
        if index is None:
            raise RankZeroFailed(f"rank 0 failed deciding for every rank: {message} (its traceback is rank 0's)")
        raise agreed(errors[index](message))
    return outcome[0]


# -- point to point, on the caller's gloo group (the memory tier's replica exchange) --------------
def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int = 0) -> None:
    check_device(tensor, group, "send")
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int = 0) -> None:
    check_device(tensor, group, "recv")
    dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int = 0):
    """Start a send; its work's ``wait()`` ends it (a stream of chunks keeps several in flight)."""
    check_device(tensor, group, "isend")
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int = 0):
    """Start a receive into ``tensor``; its work's ``wait()`` ends it."""
    check_device(tensor, group, "irecv")
    return dist.irecv(tensor, src, group=group, tag=tag)


def exchange(sends: Sequence[Tuple[torch.Tensor, int, int]], recvs: Sequence[Tuple[torch.Tensor, int, int]],
             group: dist.ProcessGroup) -> None:
    """Post every (tensor, peer, tag) send and receive at once, then wait for all of them: a ring
    where each rank sends to one peer and receives from another cannot deadlock."""
    works = [isend(tensor, peer, group, tag) for tensor, peer, tag in sends]
    works += [irecv(tensor, peer, group, tag) for tensor, peer, tag in recvs]
    for work in works:
        work.wait()
