"""What the benchmarks in scripts/ share, so that each one says only what it measures.

Performance targets live in those benchmarks, never as timed asserts in tests, and each is a ratio: to
a floor (what the hardware does with the same bytes: a copy, a disk write, a read) or to a peer (the
same work done another way), both measured in the same run, beside what they bound. A shared machine's
memory bandwidth moves by 1.5x and its disk by 2x from one second to the next, so a floor taken once at
the start says little about a measurement a minute later; variants are run in turns and compared by
their medians.

  in_turns, seconds, spread    variants alternated round by round; the median and the min of repeats
  against                      a ratio with its target and verdict: ``1.23x (target <= 1.5x) MET``
  Memcpy                       the copy floor: bytes into an already-touched buffer (staging reuses its
                               buffers); from a GPU, into pinned host memory
  write_floor, read_floor      a file written and fsynced, files read sequentially: the disk's floors
  drop_page_cache              cold reads (root only)
  MetricsTail, resumed         metrics.jsonl rows stamped with the moment each appeared: what a step's
                               own step_s does not see (the stalls after it, a restart until its first step)
  model_preset                 a configs/model/ preset as a ModelConfig, with overrides
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, TypeVar

GiB = 2**30
CHUNK = 64 << 20  # the floors' reads and writes: 64 MiB at a time, what ``cat`` and ``dd`` reach
PRESETS = Path(__file__).resolve().parents[1] / "configs" / "model"

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def in_turns(variants: Mapping[K, Callable[[], T]], rounds: int, shift: int = 0) -> Dict[K, List[T]]:
    """Each variant called once per round, the order rotated by one every round (``shift``: where the
    rotation starts), so that the machine's load hits every variant alike; what each call returned."""
    names = list(variants)
    out: Dict[K, List[T]] = {name: [] for name in names}
    for r in range(rounds):
        k = (shift + r) % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(variants[name]())
    return out


def spread(seconds_: Iterable[float]) -> str:
    """``median 1.23 s (min 1.01, max 1.50, 5 runs)``."""
    xs = list(seconds_)
    return f"median {statistics.median(xs):.3g} s (min {min(xs):.3g}, max {max(xs):.3g}, {len(xs)} runs)"


def against(ratio: float, target: float, at_most: bool = True) -> str:
    """A ratio to its floor or peer, with the target it is held to and the verdict."""
    met = ratio <= target if at_most else ratio >= target
    return f"{ratio:.2f}x (target {'<=' if at_most else '>='} {target:g}x) {'MET' if met else 'MISSED'}"


class Memcpy:
    """The copy floor of ``nbytes``: one copy into a buffer that was touched before (staging reuses its
    buffers, so page faults are not part of the floor). From ``device`` into host memory, pinned when the
    source is on a GPU (what an async save's or a snapshot's stall is held to there)."""

    def __init__(self, nbytes: int, device: str = "cpu"):
        import torch

        self.torch = torch
        self.src = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        self.cuda = self.src.is_cuda
        self.dst = torch.empty(self.src.shape, dtype=self.src.dtype, pin_memory=self.cuda)
        self.dst.copy_(self.src)  # touch
        self.nbytes = self.src.numel() * 4

    def seconds(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        start = time.perf_counter()
        self.dst.copy_(self.src, non_blocking=self.cuda)
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - start

    def bandwidth(self, reps: int = 3) -> float:
        """Bytes per second, the median of ``reps`` copies."""
        return self.nbytes / statistics.median(self.seconds() for _ in range(reps))


def drop_page_cache() -> bool:
    """Whether the page cache could be dropped (root only): the next reads come from the disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_floor(directory: Path, nbytes: int) -> float:
    """Bytes per second of writing ``nbytes`` of random bytes to a file in ``directory`` and fsyncing it.
    The file is deleted at once, so what is written next lands in the same freed blocks (on a
    thin-provisioned virtual disk never-used blocks were measured 2x slower to write)."""
    path = Path(directory) / "write_floor.bin"
    block = memoryview(os.urandom(min(nbytes, CHUNK)))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block[:nbytes - written])
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed


def read_floor(paths: Sequence[Path], cold: bool) -> float:
    """Bytes per second of one sequential pass over ``paths`` (after dropping the page cache if ``cold``)."""
    if cold:
        drop_page_cache()
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return sum(Path(p).stat().st_size for p in paths) / (time.perf_counter() - start)


class MetricsTail(threading.Thread):
    """(arrival time, row) of each line appended to a run's metrics.jsonl, polled every 5 ms."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.rows, self._done = Path(path), [], threading.Event()

    def run(self) -> None:
        offset, buf = 0, ""
        while not self._done.is_set():
            if self.path.exists():
                with open(self.path) as f:
                    f.seek(offset)
                    buf += f.read()
                    offset = f.tell()
                *lines, buf = buf.split("\n")
                now = time.time()
                self.rows += [(now, json.loads(line)) for line in lines if line.strip()]
            time.sleep(0.005)

    def stop(self) -> None:
        self._done.set()
        self.join()


def resumed(rows: Sequence[tuple]) -> Optional[tuple]:
    """(arrival of the last resume event, the event, arrival of the first step after it) from MetricsTail's
    rows; None until that step's row has come (what a restart is timed to)."""
    last = max((i for i, (_, r) in enumerate(rows) if r.get("kind") == "resume"), default=None)
    if last is None:
        return None
    t_resume, event = rows[last]
    t_first = next((t for t, r in rows[last:] if "kind" not in r and r["step"] == event["step"] + 1), None)
    return None if t_first is None else (t_resume, event, t_first)


def model_preset(name: str, overrides: Sequence[str] = ()):
    """configs/model/<name>.yaml as a ModelConfig, changed by ``overrides`` (``n_layers=2``)."""
    from omegaconf import OmegaConf

    from model.config import ModelConfig

    merged = OmegaConf.merge(OmegaConf.load(PRESETS / f"{name}.yaml"), OmegaConf.from_dotlist(list(overrides)))
    return ModelConfig(**OmegaConf.to_container(merged))
