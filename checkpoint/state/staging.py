"""Host staging for async saves: one copy of the state into buffers reused across saves.

On CUDA the buffers are pinned, so the device-to-host copy runs at full PCIe speed; on CPU
they are ordinary memory. Reusing them avoids page-faulting fresh memory at every save
(measured ~2x faster here). The background writer only ever reads these buffers, never
live tensors; the next save waits for the previous one before overwriting them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager


def _signature(obj: Any):
    """Structure, shapes and dtypes: when it changes, the buffers are rebuilt."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return ("T", type(obj).__name__, tuple(obj.shape), tuple(local.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    return type(obj).__name__


class HostStager(AsyncStager):
    _synchronize_after_execute = False

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._buffers: Optional[Dict[str, Any]] = None
        self._signature = None
        self.rebuilds = 0  # how often buffers were (re)allocated: 1 in a steady run

    def stage(self, state_dict: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        sig = _signature(state_dict)
        if self._buffers is None or sig != self._signature:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
            self._signature = sig
            self.rebuilds += 1
        staged = _copy_state_dict(state_dict, self._buffers, non_blocking=self.pin_memory, type_check=False)
        if self.pin_memory:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers = None
