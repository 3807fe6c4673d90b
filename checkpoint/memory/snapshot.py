"""One rank's training state as one file of bytes: the memory tier's unit (checkpoint/memory/tier.py).

A snapshot restores at the layout it was taken at, so DCP's planning is left out: it is this rank's
local shards and pickled values, back to back, behind an index (docs/checkpoint-format.md, "Files"):

    MAGIC (8 bytes) | index length (8, little endian) | index (pickle) | data ...

A restore copies each tensor's bytes into the live local tensor of the state dict
``TrainingState.state_dict()`` builds now, then hands the dict to ``load_state_dict``, the path a durable
load ends in; other keys, shapes or dtypes are a SnapshotError (another layout or model). The file is
checksummed while it is written; the checksum lives in the copy's manifest beside it.

After the apply, every tensor the state holds is compared byte for byte with the snapshot
(``check_applied``): that, not the probe's forward, proves the weights. A snapshot is restored only at the
layout it was taken at, into the same local tensors, so equal bytes are the same weights (and optimizer
and EMA state, which the probe never sees). Its manifest therefore has no probe loss: ``probe_method`` says
``APPLIED_BYTES`` and post-load verification (recovery/verify.py) checks step and LR only.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from checkpoint.durable.manifest import hasher
from checkpoint.durable.staging import host_buffer

STEP_DIR = "step_{:08d}"  # a step's copies: STEP_DIR/rankR.snap and its commit, rankR.json
MAGIC = b"LLMSNAP1"
_HEAD = struct.Struct("<8sQ")
CHUNK = 64 << 20  # bytes hashed at a time when a whole buffer is checked (checksum_buffer)
PIECE = 1 << 20  # bytes hashed then written at a time: small enough to stay in a core's cache in between


class SnapshotError(RuntimeError):
    """A snapshot that cannot be applied here: damaged, or from another layout or model."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_leaves(obj: Any, path: Tuple = ()) -> List[Tuple[Tuple, Any]]:
    """(key path, leaf) of every leaf of nested dicts and lists, in a fixed order."""
    if isinstance(obj, dict):
        return [leaf for k in obj for leaf in state_leaves(obj[k], path + (k,))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in state_leaves(v, path + (i,))]
    return [(path, obj)]


class Staged:
    """One snapshot, staged: the file is ``prefix`` (magic, index length, index, the pickled components'
    bytes) then ``region`` (every tensor's bytes in one reused host buffer, written to tmpfs and sent to
    the peer as it is: one contiguous buffer, never read back from the file)."""

    def __init__(self, prefix: bytes, region: torch.Tensor):
        self.prefix, self.region = prefix, region


def _layout(sd: Dict[str, Any]):
    """(path, leaf, local tensor or None) of every leaf, and the signature of the tensor layout."""
    leaves, sig = [], []
    for path, leaf in state_leaves(sd):
        t = local_tensor(leaf).detach() if isinstance(leaf, torch.Tensor) else None
        leaves.append((path, leaf, t))
        if t is not None:
            sig.append((path, t.dtype, tuple(t.shape)))
    return leaves, tuple(sig)


class FlatStager:
    """The training thread's copy: every tensor's local bytes into one flat host buffer, reused from
    snapshot to snapshot while the shapes stay (pinned on CUDA by registering its pages,
    checkpoint/durable/staging.py: no power-of-two rounding); at most one snapshot is in flight,
    so the background half of the previous one is done with the buffer before it is overwritten.
    Tensors are laid out back to back in state-dict order at fixed offsets within the region; the
    pickled components (which change length) go in the prefix, ahead of the region."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._region: Optional[torch.Tensor] = None
        self._signature = None

    def stage(self, sd: Dict[str, Any]) -> Staged:
        leaves, sig = _layout(sd)
        if self._region is None or sig != self._signature:
            total = sum(t.numel() * t.element_size() for _, _, t in leaves if t is not None)
            self._region = None  # free the old one first
            self._region = host_buffer(total, self.pin_memory)  # pinned bytes = the state's (staging.py)
            self._signature = sig
        region = self._region
        entries: List[dict] = []
        extra: List[bytes] = []  # the pickled components' bytes, in the prefix after the index
        tensors: List[Tuple[dict, torch.Tensor, int]] = []
        offset = 0
        for path, leaf, t in leaves:
            if t is not None:
                nbytes = t.numel() * t.element_size()
                entry = {"path": path, "kind": "tensor", "nbytes": nbytes,
                         "dtype": str(t.dtype).removeprefix("torch."), "shape": tuple(t.shape)}
                if nbytes:
                    src = t if t.is_contiguous() else t.contiguous()
                    region[offset:offset + nbytes].copy_(src.reshape(-1).view(torch.uint8),
                                                         non_blocking=self.pin_memory)
                tensors.append((entry, t, offset))
                offset += nbytes
            elif isinstance(leaf, (bytes, bytearray)):
                entry = {"path": path, "kind": "bytes", "nbytes": len(leaf)}
                extra.append(bytes(leaf))
            else:  # a float, an int, a tuple of betas ... lives in the index
                entry = {"path": path, "kind": "value", "value": leaf}
            entries.append(entry)
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        # data offsets count from the end of the index: the components' bytes first, then the region
        at = 0
        for e in entries:
            if e["kind"] == "bytes":
                e["offset"], at = at, at + e["nbytes"]
        for e, _, off in tensors:
            e["offset"] = at + off
        index = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
        return Staged(b"".join([_HEAD.pack(MAGIC, len(index)), index, *extra]), region)

    def close(self) -> None:
        self._region = None


class HashedWriter:
    """Writes buffers back to back to ``path`` (through ``path.tmp`` and a rename), hashing each
    piece of ``PIECE`` bytes just after writing it, while it is still in the cache: one pass over
    the bytes from memory, the checksum of exactly the bytes the file took. (Measured here on 0.78
    GiB: 64 MiB written then hashed 0.366 s of CPU, 1 MiB pieces 0.328 s.) A failure is kept,
    not raised (``error``): the caller may be in the middle of a transfer it must finish (the
    replica, PeerGroup.exchange), so later writes are dropped and ``finish`` raises it. ``before_write``
    runs before each write as part of it (the fault hook: an injected ENOSPC fails it like a real one).

    ``reuse``: a file of an older, uncommitted copy (MemoryTier's spares) to write over instead of a
    new one: a new tmpfs file allocates and clears every page as it is written, which measured 0.26 s
    of CPU for 0.78 GiB here against 0.19 s for writing over pages the file already holds. The file
    is cut to the bytes written at the end, so nothing of the old copy is left in it."""

    def __init__(self, path: Path, algorithm: str, before_write: Optional[Callable[[], None]] = None,
                 reuse: Optional[Path] = None):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.before_write = before_write
        self.hash, self.size, self.error = hasher(algorithm), 0, None
        self._file, self.reused = None, False
        try:
            try:
                if reuse is None:
                    raise FileNotFoundError
                os.replace(reuse, self.tmp)
                self._file, self.reused = open(self.tmp, "r+b", buffering=0), True
            except FileNotFoundError:
                self._file = open(self.tmp, "wb", buffering=0)
        except OSError as exc:
            self.error = exc

    def mapped(self, size: int) -> Optional[torch.Tensor]:
        """The file's first ``size`` bytes as memory, for bytes received straight into it (then ``hashed``),
        or None: only a reused file's, whose pages exist (a new file's would be allocated, cleared and
        mapped page by page: 0.38 s of CPU for 0.78 GiB here, more than writing it). Pages for any growth
        are allocated first, so a full tmpfs is an error here, never a fault inside a receive. The mapping
        lives as long as the tensors over it (a receive still in flight keeps it)."""
        if self.error is not None or not self.reused or size <= 0:
            return None
        try:
            if self.before_write is not None:
                self.before_write()
            fd = self._file.fileno()
            have = os.fstat(fd).st_size
            if size > have:
                os.posix_fallocate(fd, have, size - have)
            return torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE),
                                    dtype=torch.uint8)
        except Exception as exc:  # noqa: BLE001 - kept for finish(), as a failed write
            self.error = exc
            self.abort()
            return None

    def hashed(self, view: torch.Tensor) -> None:
        """``view``, the next bytes of the file, arrived in ``mapped``'s memory: hashed as stored."""
        if self.error is None:
            self.hash.update(memoryview(view.numpy()))
            self.size += view.numel()

    def write(self, part) -> None:
        if self.error is not None:
            return
        part = memoryview(part.numpy() if isinstance(part, torch.Tensor) else part).cast("B")
        try:
            if self.before_write is not None:
                self.before_write()
            for start in range(0, len(part), PIECE):
                piece = part[start:start + PIECE]
                while len(piece):
                    n = self._file.write(piece)
                    self.hash.update(piece[:n])  # the bytes the write just read: still in the cache
                    piece = piece[n:]
                    self.size += n
        except Exception as exc:  # noqa: BLE001 - kept for finish(); the caller may still be receiving
            self.error = exc
            self.abort()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> Tuple[int, str]:
        """(size, checksum) once the file is in place; the first failure, raised."""
        if self.error is not None:
            self.abort()
            raise self.error
        try:
            self._file.truncate(self.size)  # a reused file may have been longer
            self._file.close()
            self._file = None
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.size, self.hash.hexdigest()


def write_parts(path: Path, parts, algorithm: str, reuse: Optional[Path] = None) -> Tuple[int, str]:
    """Write ``parts`` (buffers) back to back to ``path``, hashed as written (HashedWriter, over
    ``reuse`` if it exists); returns (size, checksum)."""
    writer = HashedWriter(path, algorithm, reuse=reuse)
    for part in parts:
        writer.write(part)
    return writer.finish()


def write_snapshot(path: Path, staged, algorithm: str, reuse: Optional[Path] = None) -> Tuple[int, str]:
    """Write a staged snapshot (or a state dict, staged here) to ``path`` (over ``reuse`` if it
    exists); returns (size, checksum)."""
    if not isinstance(staged, Staged):
        staged = FlatStager().stage(staged)
    return write_parts(path, [staged.prefix, staged.region], algorithm, reuse)


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
    live = dict(state_leaves(sd))
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
        dst = local_tensor(live[path])
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


def check_applied(state, buf: torch.Tensor) -> None:
    """After ``apply_snapshot``: every tensor of the state dict taken again (what the model, the
    optimizer and the EMA hold now, after ``load_state_dict``'s own copies) equals the snapshot's
    bytes for its key. A leaf damaged, or put in another leaf's place, by the apply or the load is
    a SnapshotError naming it. Compared where the tensor lives (one copy of the snapshot's bytes to
    the device on a GPU): no hash, no forward."""
    entries, base = parse_index(buf)
    live = dict(state_leaves(state.state_dict()))
    wrong = []
    for e in entries:
        if e["kind"] != "tensor":
            continue  # values and pickled components: step and LR are checked by recovery/verify.py
        t = live.get(e["path"])
        raw = buf[base + e["offset"]:base + e["offset"] + e["nbytes"]]
        got = None
        if isinstance(t, torch.Tensor):
            local = local_tensor(t).detach()
            got = local.contiguous().reshape(-1).view(torch.uint8) if local.numel() else raw[:0]
        if got is None or got.numel() != raw.numel() or not torch.equal(got, raw.to(got.device)):
            wrong.append(".".join(map(str, e["path"])))
    if wrong:
        raise SnapshotError(f"after the apply, {len(wrong)} tensor(s) differ from the snapshot's bytes "
                            f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}): the restore did not "
                            "put every leaf back where it was taken from")
