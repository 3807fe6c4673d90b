"""Config-driven fault injection: prove recovery works by breaking things on purpose.

Off by default (``recovery.faults: []``). A fault (``FaultConfig`` in recovery/config.py: its kinds,
phases and checks; docs/recovery-runbook.md says what each does) names a kind, a phase, a step and a
rank. The run's one injector is called at every phase boundary (the loop's phases, the checkpoint
saver's and the memory tier's ``fault_hook``, the post-load check, every manifest read) and fires a
fault that matches. A fault fires once per run directory (``slow``: at every match): a marker file is
made durable *before* it fires, so the restarted job, which passes the same step again after resuming
from an earlier checkpoint, does not fire it a second time.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterable, List, Optional

from checkpoint.durable.manifest import MANIFEST
from configs.keys import problems as problems_of
from recovery.config import CORRUPTIONS, FaultConfig

log = logging.getLogger("trainer")


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault; its message says it was injected."""


class FaultInjector:
    def __init__(self, faults: Iterable, run_dir: Path | str, rank: int):
        """``faults``: FaultConfig objects or dicts of their fields (``cfg.recovery.faults``)."""
        parsed = [f if isinstance(f, FaultConfig) else FaultConfig(**dict(f)) for f in faults]
        problems = [p for i, f in enumerate(parsed) for p in problems_of(f, f"recovery.faults[{i}]")
                    + f.check(f"recovery.faults[{i}]")]
        if problems:
            raise ValueError("; ".join(problems))
        self.faults: List[FaultConfig] = [f for f in parsed if f.rank in (-1, rank)]
        self.dir = Path(run_dir) / "faults"
        self.rank = rank
        self._kill_lock = threading.Lock()

    def _claim(self, index: int, fault: FaultConfig, step: int, n: int = 0, what: str = "fired") -> bool:
        """Durably record that the fault fires now (its ``n``-th time; ``what="passed"``: is passed
        over); False if that already happened."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{fault.kind}-{fault.phase}-step{fault.step}-rank{fault.rank}" + (
            f"-{fault.corruption}" if fault.kind == "corrupt" else "")
        marker = self.dir / f"{what}-{index}-{name}-on-rank{self.rank}{f'-{n + 1}' if n else ''}"
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
            if fault.kind == "slow":  # a lasting condition, not an event: no marker, every match
                time.sleep(fault.delay_s)
                continue
            if any(self._claim(i, fault, step, n, "passed") for n in range(fault.skip)):
                continue  # one of the first ``skip`` matches
            if fault.kind in ("sigkill", "node_loss"):
                # One death per process: while one thread kills the process, a sigkill due at the
                # same moment in another thread (the background checkpoint writer) must not claim
                # its marker too, or it would be recorded as fired without ever killing anything.
                with self._kill_lock:
                    if self._claim(i, fault, step):
                        self._fire(fault, step, model, path)
                continue
            if fault.times != -1 and not any(self._claim(i, fault, step, n) for n in range(fault.times)):
                continue
            self._fire(fault, step, model, path)

    def _fire(self, fault: FaultConfig, step: int, model, path: Optional[Path]) -> None:
        log.warning("fault injection: %s at step %d (phase %s, rank %d, pid %d)", fault.kind, step, fault.phase,
                    self.rank, os.getpid())
        for h in logging.getLogger().handlers:
            h.flush()
        if fault.kind == "node_loss":
            agent = os.getppid()
            if agent > 1 and os.environ.get("TORCHELASTIC_RUN_ID"):  # only a launcher, never a shell or pytest
                os.kill(agent, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        elif fault.kind == "sigkill":
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
            name, value = flip_bit_in_model(model, fault.bit, grad=fault.kind == "bitflip_grad", param=fault.param)
            log.warning("fault injection: flipped bit %d of %s%s[0] on rank %d (now %r)", fault.bit, name,
                        ".grad" if fault.kind == "bitflip_grad" else "", self.rank, value)
        elif fault.kind == "corrupt":
            if path is None:
                raise ValueError(f"a corrupt fault needs the checkpoint path at its injection point ({fault.phase})")
            what = corrupt_checkpoint(Path(path), fault.corruption)
            log.warning("fault injection: corrupted %s (%s)", path, what)
        elif fault.kind == "disk_full":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected disk_full fault)", str(path))
        elif fault.kind == "read_error":
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected read_error fault)", str(path))


def flip_bit_in_model(model, bit: int, grad: bool = False, param: str = ""):
    """Flip ``bit`` of the first element of this rank's shard of the weight named ``param`` (by
    default the first matrix weight of the first block: the first whose name holds a layer index), or of
    its gradient, as a silent hardware fault would; returns (name, new value)."""
    import torch

    params = dict(model.named_parameters())
    if param:
        if param not in params:
            raise ValueError(f"recovery.faults: no parameter {param!r} to flip a bit in; the model has "
                             f"{', '.join(list(params)[:6])}, ...")
        name = param
    else:
        matrices = [n for n, p in params.items() if p.ndim >= 2]
        name = next((n for n in matrices if any(part.isdigit() for part in n.split("."))), matrices[0])
    param = params[name]
    target = param.grad if grad else param
    if target is None:
        raise ValueError(f"bitflip_grad: {name} has no gradient at this point")
    local = target.to_local() if hasattr(target, "to_local") else target
    with torch.no_grad():
        words = local.detach().view(-1)[:1].view(torch.int32)
        words ^= 1 << bit if bit < 31 else -(1 << 31)
    return name, float(local.detach().reshape(-1)[0])


def corrupt_checkpoint(path: Path, how: str) -> str:
    """Damage the checkpoint directory ``path`` as real storage does; return what was done.

    Deterministic (the largest data file, the byte in its middle), so a test knows exactly
    what the loader must catch."""
    path = Path(path)
    if how == "delete_manifest":
        if not (path / MANIFEST).exists():
            raise FileNotFoundError(f"no {MANIFEST} in {path}")
        (path / MANIFEST).unlink()
        return f"deleted {MANIFEST}"
    files = [p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST]
    if not files:
        raise FileNotFoundError(f"no data files to corrupt in {path}")
    target = max(files, key=lambda p: (p.stat().st_size, str(p)))
    size = target.stat().st_size
    if how == "truncate":
        os.truncate(target, size // 2)
        return f"truncated {target.relative_to(path)} from {size} to {size // 2} bytes"
    if how == "flip_byte":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        return f"flipped byte {size // 2} of {target.relative_to(path)}"
    if how == "delete_file":
        target.unlink()
        return f"deleted {target.relative_to(path)}"
    raise ValueError(f"corruption {how!r}: choose one of {list(CORRUPTIONS)}")
