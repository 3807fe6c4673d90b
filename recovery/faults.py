"""Config-driven fault injection: prove recovery works by breaking things on purpose.

Off by default (``recovery.faults: []``). Each fault names a kind, a phase, a step and a
rank; code at every phase boundary calls ``maybe_inject(phase, step)``, which is a no-op
unless a configured fault matches. A fault fires once per run directory: a marker file
is made durable *before* it fires, so the restarted job (which passes the same step again
after resuming from an earlier checkpoint) does not fire it a second time.

Kinds: ``sigkill`` (the process dies with no chance to clean up), ``hang`` (sleeps; the
watchdog must notice), ``exception``, ``nan_loss`` (poisons a parameter so the next loss is
NaN; needs ``model=``), ``corrupt`` (damages the checkpoint at ``path=``, see
recovery/corrupt.py), ``bitflip_param`` / ``bitflip_grad`` (one flipped bit in a weight before
the forward pass, or in a gradient after backward: silent corruption for recovery/guards). Phases: the watchdog's (``step``, ``data_wait``, ...) plus the
checkpoint's internal ones (``checkpoint_snapshot``, ``checkpoint_write``,
``checkpoint_commit``, ``checkpoint_retention``, ``checkpoint_committed``,
``checkpoint_load``). ``step=-1`` matches any step; ``rank=-1`` every rank.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

log = logging.getLogger("trainer")

KINDS = ("sigkill", "hang", "exception", "nan_loss", "corrupt", "bitflip_param", "bitflip_grad")
INJECTION_PHASES = ("step", "data_wait", "gradients", "checkpoint_snapshot", "checkpoint_write",
                    "checkpoint_commit", "checkpoint_retention", "checkpoint_committed", "checkpoint_load")


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault; its message says it was injected."""


@dataclass(frozen=True)
class Fault:
    kind: str
    phase: str
    step: int = -1
    rank: int = 0
    corruption: str = "flip_byte"
    hang_s: float = 3600.0
    bit: int = 30  # bitflip_*: which bit of the fp32 word (30: top exponent bit, value x 2^128)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.phase}-step{self.step}-rank{self.rank}" + (
            f"-{self.corruption}" if self.kind == "corrupt" else "")

    def validate(self) -> None:
        from recovery.corrupt import CORRUPTIONS

        if self.kind not in KINDS:
            raise ValueError(f"recovery.faults: kind={self.kind!r}: choose one of {list(KINDS)}")
        if self.phase not in INJECTION_PHASES:
            raise ValueError(f"recovery.faults: phase={self.phase!r}: choose one of {list(INJECTION_PHASES)}")
        if self.kind == "corrupt" and self.corruption not in CORRUPTIONS:
            raise ValueError(f"recovery.faults: corruption={self.corruption!r}: choose one of {list(CORRUPTIONS)}")
        if self.kind == "bitflip_param" and self.phase != "step":
            raise ValueError("recovery.faults: bitflip_param flips a weight before the forward pass: use phase=step")
        if self.kind == "bitflip_grad" and self.phase != "gradients":
            raise ValueError("recovery.faults: bitflip_grad flips a gradient after backward: use phase=gradients")
        if self.kind.startswith("bitflip") and not 0 <= self.bit < 32:
            raise ValueError(f"recovery.faults: bit={self.bit} must be in [0, 32) (an fp32 word)")
        if self.kind == "corrupt" and self.phase != "checkpoint_committed":
            raise ValueError("recovery.faults: a corrupt fault damages a committed checkpoint: "
                             "use phase=checkpoint_committed")


class FaultInjector:
    def __init__(self, faults: Iterable[Fault], run_dir: Path | str, rank: int):
        self.faults: List[Fault] = [f for f in faults if f.rank in (-1, rank)]
        for f in self.faults:
            f.validate()
        self.dir = Path(run_dir) / "faults"
        self.rank = rank
        self._kill_lock = threading.Lock()

    def _marker(self, index: int, fault: Fault) -> Path:
        return self.dir / f"fired-{index}-{fault.name}-on-rank{self.rank}"

    def _claim(self, index: int, fault: Fault, step: int) -> bool:
        """Durably record that the fault fires now; False if it already fired in this run."""
        self.dir.mkdir(parents=True, exist_ok=True)
        marker = self._marker(index, fault)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, f"step {step} time {time.time():.3f} pid {os.getpid()}\n".encode())
        os.fsync(fd)
        os.close(fd)
        dfd = os.open(self.dir, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        return True

    def maybe_inject(self, phase: str, step: int, model=None, path: Optional[Path] = None) -> None:
        for i, fault in enumerate(self.faults):
            if fault.phase != phase or fault.step not in (-1, step):
                continue
            if fault.kind == "sigkill":
                # One death per process: while one thread kills the process, a sigkill due at the
                # same moment in another thread (the background checkpoint writer) must not claim
                # its marker too, or it would be recorded as fired without ever killing anything.
                with self._kill_lock:
                    if self._claim(i, fault, step):
                        self._fire(fault, step, model, path)
                continue
            if not self._claim(i, fault, step):
                continue
            self._fire(fault, step, model, path)

    def _fire(self, fault: Fault, step: int, model, path: Optional[Path]) -> None:
        log.warning("fault injection: %s at step %d (phase %s, rank %d, pid %d)", fault.kind, step, fault.phase,
                    self.rank, os.getpid())
        for h in logging.getLogger().handlers:
            h.flush()
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is delivered asynchronously; never run past the injection point
        elif fault.kind == "hang":
            deadline = time.monotonic() + fault.hang_s
            while time.monotonic() < deadline:
                time.sleep(0.05)
        elif fault.kind == "exception":
            raise InjectedFault(f"injected exception at step {step} in phase {fault.phase} on rank {self.rank}")
        elif fault.kind == "nan_loss":
            if model is None:
                raise ValueError(f"a nan_loss fault needs the model at its injection point (phase {fault.phase})")
            import torch

            with torch.no_grad():
                p = next(model.parameters())
                p.copy_(torch.full_like(p, float("nan")))
        elif fault.kind in ("bitflip_param", "bitflip_grad"):
            if model is None:
                raise ValueError(f"a {fault.kind} fault needs the model at its injection point ({fault.phase})")
            name, value = flip_bit_in_model(model, fault.bit, grad=fault.kind == "bitflip_grad")
            log.warning("fault injection: flipped bit %d of %s%s[0] on rank %d (now %r)", fault.bit, name,
                        ".grad" if fault.kind == "bitflip_grad" else "", self.rank, value)
        elif fault.kind == "corrupt":
            from recovery.corrupt import corrupt_checkpoint

            if path is None:
                raise ValueError(f"a corrupt fault needs the checkpoint path at its injection point ({fault.phase})")
            what = corrupt_checkpoint(Path(path), fault.corruption)
            log.warning("fault injection: corrupted %s (%s)", path, what)


def flip_bit_in_model(model, bit: int, grad: bool = False):
    """Flip ``bit`` of the first element of this rank's shard of the first matrix weight of a
    transformer block (or its gradient), as a silent hardware fault would; returns (name, new value)."""
    import torch

    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    name, param = next(((n, p) for n, p in matrices if n.startswith("layers.")), matrices[0])
    target = param.grad if grad else param
    if target is None:
        raise ValueError(f"bitflip_grad: {name} has no gradient at this point")
    local = target.to_local() if hasattr(target, "to_local") else target
    with torch.no_grad():
        words = local.detach().view(-1)[:1].view(torch.int32)
        words ^= 1 << bit if bit < 31 else -(1 << 31)
    return name, float(local.detach().reshape(-1)[0])


_INJECTOR: Optional[FaultInjector] = None


def configure(faults: Iterable, run_dir: Path | str, rank: int) -> Optional[FaultInjector]:
    """Install the process's injector from ``cfg.recovery.faults`` (dicts or Fault objects)."""
    global _INJECTOR
    parsed = [f if isinstance(f, Fault) else Fault(**dict(f)) for f in faults]
    _INJECTOR = FaultInjector(parsed, run_dir, rank) if parsed else None
    if _INJECTOR is not None and _INJECTOR.faults:
        log.warning("fault injection armed on rank %d: %s", rank, ", ".join(f.name for f in _INJECTOR.faults))
    return _INJECTOR


def maybe_inject(phase: str, step: int, model=None, path: Optional[Path] = None) -> None:
    """Fire a configured fault matching (phase, step) on this rank; a no-op by default."""
    if _INJECTOR is not None:
        _INJECTOR.maybe_inject(phase, step, model=model, path=path)
