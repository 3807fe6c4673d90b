"""What scripts/gpu_check.py measures inside a process, so the check runs what users run.

  python scripts/instrumented.py env                                  # the environment, as JSON
  python scripts/instrumented.py train --report R.json [--deterministic] [--floor-bytes N] -- OVERRIDES

``train`` runs the real train.py (runpy, as ``python train.py OVERRIDES`` would) and, at exit,
writes to R.json what metrics.jsonl cannot say: the allocator's peaks (``max_memory_reserved``:
the memory the run really took from the device, where the step rows log the allocated peak),
the probe's own peak (recovery/probe.py runs a forward of its 4 sequences, one at a time, at
every durable save, shadow check and resume), and the device-to-host copy floor of
``--floor-bytes`` into pinned memory, measured in this process after training, the floor an
async save's or a memory snapshot's stall is held to.
``--deterministic`` sets CUBLAS_WORKSPACE_CONFIG and torch.use_deterministic_algorithms before
train.py starts: a killed and resumed run is then bitwise comparable on a GPU.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict:
    """torch, CUDA, the GPU and NCCL, as this machine has them."""
    import platform

    import torch

    from metrics.throughput import peak_tflops_of

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), peak_tflops=peak_tflops_of(props.name))
    return env


class Measured:
    """The peaks of the whole run and of each probe call; the probe resets the allocator's peak
    counters around itself, so the run's peak is kept here as the maximum over the pieces."""

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.peak_reserved = self.peak_allocated = 0
        self.before_probe: dict = {}  # the run's peaks when the probe first ran (what the planner predicts)
        self.probes: list = []
        self.floor: dict | None = None

    def _fold_peaks(self) -> None:
        if self.cuda:
            self.peak_reserved = max(self.peak_reserved, self.torch.cuda.max_memory_reserved())
            self.peak_allocated = max(self.peak_allocated, self.torch.cuda.max_memory_allocated())

    def wrap_probe(self) -> None:
        import recovery.probe as probe_module

        inner = probe_module.probe_loss

        def measured_probe(*args, **kwargs):
            self._fold_peaks()
            if not self.probes:
                self.before_probe = {"peak_reserved": self.peak_reserved, "peak_allocated": self.peak_allocated}
            cuda = self.cuda
            if cuda:
                self.torch.cuda.synchronize()
                self.torch.cuda.reset_peak_memory_stats()
            before = self.torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            loss = inner(*args, **kwargs)
            if cuda:
                self.torch.cuda.synchronize()
            self.probes.append({"seconds": time.perf_counter() - t0, "allocated_before": before,
                                "peak_allocated": self.torch.cuda.max_memory_allocated() if cuda else None,
                                "peak_reserved": self.torch.cuda.max_memory_reserved() if cuda else None})
            self._fold_peaks()
            return loss

        probe_module.probe_loss = measured_probe  # Probe.__call__ looks the name up at each call

    def measure_floor(self, nbytes: int) -> None:
        """Copy ``nbytes`` from the device into pinned host memory (host to host on CPU), median of 3."""
        from rehearsal.bench import Memcpy

        floor = Memcpy(nbytes, "cuda" if self.cuda else "cpu")
        gbps = floor.bandwidth() / 1e9
        self.floor = {"bytes": floor.nbytes, "seconds": floor.nbytes / gbps / 1e9, "gbps": gbps, "pinned": self.cuda}

    def report(self) -> dict:
        self._fold_peaks()
        cuda = self.cuda
        first = self.before_probe if self.probes else {"peak_reserved": self.peak_reserved,
                                                       "peak_allocated": self.peak_allocated}
        return {"cuda": cuda, "peak_reserved": self.peak_reserved if cuda else None,
                "peak_allocated": self.peak_allocated if cuda else None,
                "peak_reserved_before_probe": first["peak_reserved"] if cuda else None,
                "peak_allocated_before_probe": first["peak_allocated"] if cuda else None,
                "probes": self.probes, "floor": self.floor}


def train(report: Path, overrides: list, deterministic: bool, floor_bytes: int) -> None:
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    import torch

    if deterministic:
        torch.use_deterministic_algorithms(True)
    measured = Measured()
    measured.wrap_probe()

    def write() -> None:
        if floor_bytes > 0:
            try:
                measured.measure_floor(floor_bytes)
            except Exception as exc:  # the report still says what the run measured
                measured.floor = {"error": f"{type(exc).__name__}: {exc}"}
        report.write_text(json.dumps(measured.report(), indent=1))

    atexit.register(write)
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env")
    t = sub.add_parser("train")
    t.add_argument("--report", type=Path, required=True)
    t.add_argument("--deterministic", action="store_true")
    t.add_argument("--floor-bytes", type=int, default=0)
    t.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(json.dumps(environment()))
    else:
        train(args.report, args.overrides, args.deterministic, args.floor_bytes)


if __name__ == "__main__":
    main()
