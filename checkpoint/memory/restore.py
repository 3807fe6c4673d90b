"""Restoring from the memory tier, on every rank together.

Each rank lists the committed copies its node holds; all ranks gather the lists and pick the
newest step for which every rank has a copy at this world size and layout; holders check the
checksums of their own copies; each rank then takes its own node's copy (local) or, failing
that, a peer's, streamed over the tier's group (peer). Any problem on any rank (no intact copy,
a copy that does not apply) is agreed on and reported, and the caller goes to the durable tier.

After the apply, every tensor the state now holds is compared byte for byte with the snapshot
(``check_applied``): that, not the probe's forward, proves the weights. A snapshot is restored
only at the world size and layout it was taken at, into the same local tensors, so equal bytes
are the same weights (and the same optimizer and EMA state, which the probe never sees); the
snapshot's bytes are the staged ones (their checksum, taken while they were written, passed before
the apply). The snapshots' manifests therefore carry no probe loss: ``probe_method`` says
``APPLIED_BYTES`` (checkpoint/durable/manifest.py) instead, and post-load verification
(recovery/verify.py) checks step and LR only.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from checkpoint.durable.manifest import ConfigMismatch, Manifest
from checkpoint.memory.snapshot import (
    SnapshotError,
    apply_snapshot,
    checksum_buffer,
    local_tensor,
    parse_index,
    state_leaves,
)

log = logging.getLogger("trainer")

@dataclass
class Restored:
    """What ``restore`` did. ``problem`` set: the state may be partly overwritten and the caller
    must load the durable tier."""

    step: int
    manifest: Optional[Manifest]
    sources: Dict[int, str] = field(default_factory=dict)  # rank -> local | peer
    problem: Optional[str] = None
    timings: Dict[str, float] = field(default_factory=dict)


def held_copies(directory: Path) -> List[dict]:
    """The committed copies in this node's directory (any owner)."""
    out = []
    for meta in sorted(directory.glob("step_*/rank*.json")):
        try:
            info = json.loads(meta.read_text())
            info["path"] = str(meta.with_suffix(".snap"))
            out.append(info)
        except (OSError, ValueError) as exc:
            log.warning("memory tier: unreadable copy manifest %s (%s): ignored", meta, exc)
    return out


def restore(tier, state, newer_than: int = 0, allow_config_change: bool = False) -> Optional[Restored]:
    """Restore ``state`` from the newest step every rank can get an intact copy of (and newer
    than ``newer_than``, the newest durable checkpoint). None: nothing usable, nothing touched.
    A snapshot taken with another config is refused as a durable resume refuses it
    (ConfigMismatch), unless ``allow_config_change``; every rank sees the same copies, so every
    rank decides the same."""
    t0 = time.perf_counter()
    held = held_copies(tier.dir)
    everyone = tier.peers.gather([{k: v for k, v in h.items() if k != "manifest"} | {"holder": tier.rank}
                             for h in held])
    copies = [c for per_rank in everyone for c in per_rank]
    if not copies:
        return None
    usable = [c for c in copies if c["world_size"] == tier.world_size and c["layout"] == tier.layout]
    if not usable:
        c = copies[0]
        if tier.rank == 0:
            log.warning("memory tier: the snapshots in memory were taken at world %d, layout %s; this run has "
                        "world %d, layout %s: they are ignored, resuming from the durable tier", c["world_size"],
                        c["layout"], tier.world_size, tier.layout)
        return None
    _check_config(tier, [c for c in usable if c["step"] > newer_than], allow_config_change)
    for step in sorted({c["step"] for c in usable}, reverse=True):
        if step <= newer_than:
            if tier.rank == 0:
                log.info("memory tier: the newest snapshot (step %d) is not newer than the durable checkpoint of "
                         "step %d: resuming from the durable tier", step, newer_than)
            return None
        at_step = [c for c in usable if c["step"] == step]
        if {c["owner"] for c in at_step} != set(range(tier.world_size)):
            continue
        restored = _restore_step(tier, state, step, at_step, [h for h in held if h["step"] == step], t0)
        if restored is not None:
            return restored
    if tier.rank == 0:
        log.warning("memory tier: no step has an intact copy for every rank: resuming from the durable tier")
    return None


def _check_config(tier, newer: List[dict], allow_config_change: bool) -> None:
    changed = sorted({c["step"] for c in newer if c.get("config_hash") != tier.config_hash})
    if not changed:
        return
    hashes = sorted({str(c.get("config_hash")) for c in newer if c["step"] in changed})
    msg = (f"the memory tier's snapshots of step(s) {changed} were taken with another config (hash "
           f"{', '.join(hashes)}; this run {tier.config_hash})")
    if not allow_config_change:
        raise ConfigMismatch(msg + ". Resume with the same settings, set checkpoint.allow_config_change=true to "
                                   "accept the change, or checkpoint.resume=never to start afresh")
    if tier.rank == 0:
        log.warning("checkpoint.allow_config_change=true: %s", msg)


def _restore_step(tier, state, step: int, at_step: List[dict], mine: List[dict], t0: float) -> Optional[Restored]:
    t1 = time.perf_counter()
    own, own_buf = next((h for h in mine if h["owner"] == tier.rank), None), None
    if own is not None:  # this rank's own copy is verified here; a replica by its receiver, on arrival
        try:
            data = torch.from_file(own["path"], shared=False, size=own["size"], dtype=torch.uint8)
            if checksum_buffer(data.numpy(), own["algorithm"]) == own["checksum"]:
                own_buf = data
            else:
                log.error("memory tier: the copy of rank %d step %d in %s fails its checksum", tier.rank, step,
                          own["path"])
        except (OSError, RuntimeError) as exc:
            log.error("memory tier: the copy of rank %d step %d is unreadable: %s", tier.rank, step, exc)
    verify_s = time.perf_counter() - t1
    own_intact = tier.peers.gather(own_buf is not None)
    sources: Dict[int, Optional[int]] = {}
    for r in range(tier.world_size):
        others = sorted(c["holder"] for c in at_step if c["owner"] == r and c["holder"] != r)
        sources[r] = r if own_intact[r] else (others[0] if others else None)
    missing = [r for r, h in sources.items() if h is None]
    if missing:
        if tier.rank == 0:
            log.warning("memory tier: step %d has no intact copy for rank(s) %s", step, missing)
        return None
    t2 = time.perf_counter()
    buf, problem, manifest_json = None, None, None
    for r in range(tier.world_size):  # one transfer at a time, in rank order: every rank agrees on it
        h = sources[r]
        if h == r:
            if r == tier.rank:
                buf, manifest_json = own_buf, own.get("manifest")
        elif tier.rank == h:
            tier.peers.send_copy(next(x for x in mine if x["owner"] == r), r)
        elif tier.rank == r:
            buf, manifest_json, problem = tier.peers.receive_copy(h)
    read_s = time.perf_counter() - t2
    manifest, apply_s, check_s = None, 0.0, 0.0
    if problem is None:
        try:
            t3 = time.perf_counter()
            manifest = Manifest.from_json(json.dumps(manifest_json))
            apply_snapshot(state, buf)
            t4 = time.perf_counter()
            check_applied(state, buf)  # instead of the probe's forward (module docstring)
            apply_s, check_s = t4 - t3, time.perf_counter() - t4
        except Exception as exc:  # noqa: BLE001 - a copy that does not apply is a problem to agree on
            problem = f"rank {tier.rank}: {type(exc).__name__}: {exc}"
    names = {r: "local" if h == r else "peer" for r, h in sources.items()}
    timings = {"verify_s": round(verify_s, 3), "read_s": round(read_s, 3), "apply_s": round(apply_s, 3),
               "check_s": round(check_s, 3), "total_s": round(time.perf_counter() - t0, 3)}
    return Restored(step, manifest, names, problem, timings)


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
