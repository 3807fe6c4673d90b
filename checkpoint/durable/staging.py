"""Host buffers for the copies of the state a save or a snapshot makes: one allocation per stager, made
once and reused, each tensor a view into it (docs/checkpoint-format.md, "Host staging").

- Pinned on CUDA by registering the buffer's pages (cudaHostRegister, as DCP's own stager pins shared
  memory), not by CUDA's caching host allocator: that one rounds every allocation up to a power of two and
  keeps it, so a buffer per tensor pinned up to 2x the state. Registered, the pinned bytes are the state's.
- Shared (``share``, for ``async_process``) from the start: DCP sends the staged dict to its writer process
  through a pipe, and torch's pickling moves any storage not yet in shared memory into /dev/shm, in place.
  Staged in ordinary (or pinned) memory, the first save turned the buffers into unpinned shared memory that
  the pre-flight did not count; shared from the start, the send passes a file descriptor and moves nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, Optional

import torch
import torch.cuda._pin_memory_utils as pinning
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

ALIGN = 64  # bytes: each view starts at a multiple, so any dtype can view its slice


def _register(buf: torch.Tensor) -> None:
    """Pin ``buf``'s pages for as long as ``buf`` lives (CUDA only)."""
    pinning.pin_memory(buf.data_ptr(), buf.numel())
    weakref.finalize(buf, pinning.unpin_memory, buf.data_ptr())


def host_buffer(nbytes: int, pin: bool, share: bool = False) -> torch.Tensor:
    """``nbytes`` of host memory (uint8): in shared memory with ``share``, registered with CUDA with ``pin``."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if share:
        buf.share_memory_()
    if pin and nbytes:
        _register(buf)
    return buf


def _local_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of nested dicts, lists and tuples (a DTensor's local shard), in a fixed order."""
    if isinstance(obj, DTensor):
        yield obj._local_tensor
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _local_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _local_tensors(v)


def _with_tensors(obj: Any, views: Iterator[torch.Tensor]) -> Any:
    """``obj`` with the next of ``views`` in place of each tensor, in ``_local_tensors``' order (a DTensor keeps
    its spec, its local shard is the view). Other values are not kept: the staged dict takes the live ones."""
    if isinstance(obj, DTensor):
        # Built on an offset-0 stand-in, then given the view (as torch's _create_cpu_state_dict sets
        # _local_tensor): the wrapper takes its local tensor's storage offset, and sending a wrapper with one
        # to the writer process pickles its empty storage (a segfault, torch 2.13).
        d = DTensor(torch.empty((), dtype=obj.dtype).expand(obj._local_tensor.shape), obj._spec, requires_grad=False)
        d._local_tensor = next(views)
        return d
    if isinstance(obj, torch.Tensor):
        return next(views)
    if isinstance(obj, dict):
        return {k: _with_tensors(v, views) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # as torch's _iterate_state_dict: a tuple stays a tuple, a list a list
        out = [_with_tensors(v, views) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    return None


def flat_copy_of(state_dict: Dict[str, Any], pin: bool, share: bool) -> tuple:
    """(buffer, like): one host buffer for every tensor of ``state_dict`` and a dict of its structure whose
    tensors are views into it, aligned to ALIGN bytes."""
    offsets, end = [], 0
    tensors = list(_local_tensors(state_dict))
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = host_buffer(end, pin, share)
    views = (buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors))
    return buf, _with_tensors(state_dict, views)


def _signature(obj: Any):
    """Structure, shapes and dtypes: when it changes, the buffers are rebuilt. Taken at every save, so a
    DTensor's shard is read as an attribute, not through ``to_local`` (an autograd function, ~20 us each)."""
    if isinstance(obj, torch.Tensor):
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        return ("T", type(obj).__name__, tuple(obj.shape), tuple(local.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    return type(obj).__name__


class HostStager(AsyncStager):
    """An async save's copy of the state into one host buffer reused from save to save (``flat_copy_of``):
    pinned on CUDA, so the device-to-host copy runs at full PCIe speed; reused, since page-faulting fresh
    memory at every save measured ~2x slower; shared with ``share_memory`` (``async_process``), so the send
    to the writer process moves nothing. The background writer reads only this buffer, never live tensors;
    the next save waits for the previous one before overwriting it."""

    _synchronize_after_execute = False

    def __init__(self, pin_memory: bool, share_memory: bool = False):
        self.pin_memory, self.share_memory = pin_memory, share_memory
        self.buffer: Optional[torch.Tensor] = None  # every staged tensor is a view into it
        self._like: Optional[Dict[str, Any]] = None
        self._signature = None
        self.rebuilds = 0  # how often the buffer was (re)allocated: 1 in a steady run

    def stage(self, state_dict: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        sig = _signature(state_dict)
        if self.buffer is None or sig != self._signature:
            self.buffer = self._like = None  # free the old one first
            self.buffer, self._like = flat_copy_of(state_dict, self.pin_memory, self.share_memory)
            self._signature = sig
            self.rebuilds += 1
        staged = _copy_state_dict(state_dict, self._like, non_blocking=self.pin_memory, type_check=False)
        if self.pin_memory and torch.cuda.is_available():  # the non-blocking copies are done
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.buffer = self._like = None
