"""One rank's training state as one file of bytes: the memory tier's unit (checkpoint/memory/tier.py).

The memory tier restores at the layout it was taken at, so no resharding is needed and DCP's
planning is left out: a snapshot is this rank's local shards (a DTensor contributes its local
tensor) and pickled values, back to back, with an index in front:

    MAGIC (8 bytes) | index length (8, little endian) | index (pickle) | data ...

The index lists every leaf of the state dict in order: its key path, kind (tensor, bytes or a
small Python value kept in the index itself), dtype, local shape, offset and length. A restore
walks the live state dict that ``TrainingState.state_dict()`` builds now, copies each tensor's
bytes into the live local tensor and hands the dict to ``TrainingState.load_state_dict``, the
same path a durable load ends in. Any difference in keys, shapes or dtypes is a SnapshotError:
the snapshot belongs to another layout or another model.

The whole file is checksummed while it is written (xxh3-64 or CRC-32, checkpoint/durable/integrity.py);
the checksum lives in the copy's manifest beside it, so a copy is verified before it is applied.
"""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from checkpoint.durable.integrity import hasher

STEP_DIR = "step_{:08d}"  # a step's copies: STEP_DIR/rankR.snap and its commit, rankR.json
MAGIC = b"LLMSNAP1"
_HEAD = struct.Struct("<8sQ")
CHUNK = 64 << 20  # bytes written and hashed at a time


class SnapshotError(RuntimeError):
    """A snapshot that cannot be applied here: damaged, or from another layout or model."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _leaves(obj: Any, path: Tuple = ()) -> List[Tuple[Tuple, Any]]:
    """(key path, leaf) of every leaf of nested dicts and lists, in a fixed order."""
    if isinstance(obj, dict):
        return [leaf for k in obj for leaf in _leaves(obj[k], path + (k,))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, path + (i,))]
    return [(path, obj)]


def _bytes_of(leaf: Any) -> Optional[memoryview]:
    if isinstance(leaf, torch.Tensor):
        t = _local(leaf).detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    if isinstance(leaf, (bytes, bytearray)):
        return memoryview(leaf)
    return None


def build_index(sd: Dict[str, Any]) -> Tuple[List[dict], List[memoryview]]:
    """The index entries of ``sd`` (a staged, host-side state dict) and the bytes to write after it."""
    entries, chunks, offset = [], [], 0
    for path, leaf in _leaves(sd):
        data = _bytes_of(leaf)
        if data is None:  # a float, an int, a tuple of betas ... lives in the index
            entries.append({"path": path, "kind": "value", "value": leaf})
            continue
        entry = {"path": path, "offset": offset, "nbytes": len(data)}
        if isinstance(leaf, torch.Tensor):
            entry.update(kind="tensor", dtype=str(leaf.dtype).removeprefix("torch."),
                         shape=tuple(_local(leaf).shape))
        else:
            entry.update(kind="bytes")
        entries.append(entry)
        chunks.append(data)
        offset += len(data)
    return entries, chunks


def write_snapshot(path: Path, sd: Dict[str, Any], algorithm: str) -> Tuple[int, str]:
    """Write ``sd`` to ``path`` (through ``path.tmp`` and a rename); returns (size, checksum)."""
    entries, chunks = build_index(sd)
    index = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
    h = hasher(algorithm)
    tmp = path.with_name(path.name + ".tmp")
    size = 0
    with open(tmp, "wb", buffering=0) as f:
        for part in [memoryview(_HEAD.pack(MAGIC, len(index))), memoryview(index), *chunks]:
            for start in range(0, len(part), CHUNK):
                piece = part[start:start + CHUNK]
                while len(piece):
                    n = f.write(piece)
                    h.update(piece[:n])
                    piece = piece[n:]
                    size += n
    os.replace(tmp, path)
    return size, h.hexdigest()


def checksum_buffer(buf, algorithm: str) -> str:
    h = hasher(algorithm)
    view = memoryview(buf)
    for start in range(0, len(view), CHUNK):
        h.update(view[start:start + CHUNK])
    return h.hexdigest()


def parse_index(buf: torch.Tensor) -> Tuple[List[dict], int]:
    """(index entries, offset of the data) of a snapshot in ``buf`` (uint8 tensor)."""
    view = memoryview(buf.numpy())
    if len(view) < _HEAD.size:
        raise SnapshotError(f"snapshot of {len(view)} bytes is shorter than its header")
    magic, n = _HEAD.unpack(view[:_HEAD.size])
    if magic != MAGIC:
        raise SnapshotError(f"not a snapshot (magic {magic!r})")
    end = _HEAD.size + n
    if n <= 0 or end > len(view):
        raise SnapshotError(f"snapshot index of {n} bytes does not fit in {len(view)} bytes")
    try:
        entries = pickle.loads(view[_HEAD.size:end])
    except Exception as exc:
        raise SnapshotError(f"snapshot index unreadable: {type(exc).__name__}: {exc}") from exc
    return entries, end


def _set(root: Any, path: Tuple, value: Any) -> None:
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _allocate_adam_state(optimizer) -> None:
    """Give a fresh Adam/AdamW its state tensors with the shapes, dtypes and devices its own first
    step would give them (``step`` where torch puts it), uninitialised: the snapshot's bytes
    overwrite every one of them (a missing or extra key is refused before anything is used).
    Without this, taking the state dict initialises them by running a whole optimizer step on
    zero gradients, which cost twice the time of the whole copy in a measurement here."""
    from torch.optim.optimizer import _get_scalar_dtype

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            on_device = group.get("capturable") or group.get("fused")
            step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
                    if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            state = {"step": step, "exp_avg": torch.empty_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.empty_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.empty_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def apply_snapshot(state, buf: torch.Tensor) -> None:
    """Restore ``state`` (a TrainingState at the snapshot's layout) from the snapshot in ``buf``."""
    entries, base = parse_index(buf)
    _allocate_adam_state(state.optimizer)
    sd = state.state_dict()
    live = dict(_leaves(sd))
    saved = {e["path"] for e in entries}
    if saved != set(live):
        missing = sorted(map(str, set(live) - saved))[:3]
        extra = sorted(map(str, saved - set(live)))[:3]
        raise SnapshotError(f"snapshot holds other state than this run (missing {missing}, unexpected {extra})")
    total = buf.numel() - base
    for e in entries:
        path = e["path"]
        if e["kind"] == "value":
            _set(sd, path, e["value"])
            continue
        if e["offset"] + e["nbytes"] > total:
            raise SnapshotError(f"{path}: bytes {e['offset']}+{e['nbytes']} beyond the data ({total} bytes)")
        raw = buf[base + e["offset"]:base + e["offset"] + e["nbytes"]]
        if e["kind"] == "bytes":
            _set(sd, path, raw.numpy().tobytes())
            continue
        dst = _local(live[path])
        dtype = getattr(torch, e["dtype"])
        if tuple(dst.shape) != tuple(e["shape"]) or dst.dtype != dtype:
            raise SnapshotError(f"{'.'.join(map(str, path))}: snapshot {e['dtype']}{list(e['shape'])}, "
                                f"this run {str(dst.dtype).removeprefix('torch.')}{list(dst.shape)}")
        with torch.no_grad():
            if dst.numel() and dst.is_contiguous():  # byte for byte: no alignment needed
                dst.reshape(-1).view(torch.uint8).copy_(raw)
            elif dst.numel():
                dst.copy_(raw.clone().view(dtype).view(dst.shape))
    state.load_state_dict(sd)
