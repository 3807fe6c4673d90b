"""One command for a lent GPU (at most 8 minutes on one GPU): what the trainer does there, measured.

  python scripts/gpu_check.py                   # on the GPU machine; prints the report folder
  python scripts/gpu_check.py --dry-run         # on CPU: the same code paths, tiny shapes (1-5 min here)

From the installed project (README: pip install -e ".[dev]"), as every script in scripts/.

Every part has its own time limit (LIMITS) inside one overall budget (--budget-s, 480 s, counted from
the start, data preparation included) and records pass, fail or skipped with the reason, so one failure
does not hide the rest:

  environment       torch, CUDA, the GPU's name and memory, NCCL (scripts/instrumented.py env)
  cuda_tests        pytest -m cuda: every test that needs a CUDA device
  fsdp_eager        train.py, one process under FSDP2 (parallel.force_fsdp: fully_shard on a size-1
                    mesh, bf16 gathered parameters, fp32 masters), bf16 autocast, the 8b shape with layers
  fsdp_compile      removed until the planner (planner/plan.py) says it fits the GPU; eager, then
                    parallel.compile=true: tokens/s, MFU against the GPU's peak
                    (metrics/throughput.py PEAK_TFLOPS), torch.cuda.max_memory_reserved against the
                    planner's total for that exact config
  probe_memory      the probe's peak (a forward of 4 sequences, one at a time, recovery/probe.py), called by
                    the guards' shadow check at step 6 of the fsdp_eager run: no time of its own
  async_checkpoint  async saves (pinned staging): the stall against the pinned device-to-host copy
                    of the same bytes, measured in the same process after training; persist
                    against a write+fsync of the same size on the same disk; a verified load
  sigkill_resume    recovery.faults SIGKILLs step 5, the rerun resumes: losses bitwise equal to an
                    uninterrupted run under torch.use_deterministic_algorithms and
                    CUBLAS_WORKSPACE_CONFIG (within TOLERANCE where determinism is refused)
  memory_tier       checkpoint.memory snapshots: the stall against the same copy floor

Every training run is the real train.py in a subprocess (through scripts/instrumented.py, which
adds the allocator's peaks and the copy floor at exit); its metrics.jsonl gives the numbers.
At one process the trainer applies no FSDP2 wrapper unless parallel.force_fsdp=true, which the two
fsdp parts set (the planner plans that exact config: gathered bf16 units, no bf16 weight copies); the
other parts run unwrapped. Checkpoints are deleted after each part (the GPU machine's disk is small);
logs and metrics stay in the report folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from rehearsal.bench import write_floor
from rehearsal.processes import kill_tree

ROOT = Path(__file__).resolve().parent.parent

BUDGET_S = 480.0  # the whole check on a GPU: 8 minutes, data preparation included
DRY_BUDGET_S = 1000.0  # the dry run: only a bound against a hang (it judges code paths, not times)
# Seconds per part: (on a GPU, in the dry run). A part gets no more than what is left of the budget.
# How the GPU limits were chosen (estimates: no GPU has run this check yet): a train.py start costs
# ~15 s (import torch, compose, the lease) plus the host-side init of its parameters (~20 ns per element
# per thread, docs/parallelism.md). fsdp_eager: the planner's fit shape is 24 layers of 8b on an H200
# (6.3B parameters, 1.0 s per step planned; 9 layers on an H100), so 8 steps and the probe take ~10 s
# and the start and init most of the rest; fsdp_compile: the same plus about a minute of Inductor;
# async_checkpoint: two starts (save, then load) of a 1.3B-parameter shape (15 GB of state) and a
# 2 GiB disk probe; sigkill_resume: three starts of the small shape (0.5B parameters), a second round
# if deterministic algorithms are refused; memory_tier: one start; cuda_tests: pytest's start and the
# few CUDA tests. They sum to the 480 s budget: a part that overruns is cut and named, the rest run.
# Dry-run limits: about twice what each part took on the shared 2-core machine at a load average of 12
# (a train.py start 20-50 s there; sigkill_resume, three starts, overran 90 s), so that load alone does
# not fail the suite's dry run; test_gpu_check checks the limit mechanism itself.
LIMITS = {"environment": (20, 60), "cuda_tests": (60, 90), "fsdp_eager": (90, 150), "fsdp_compile": (120, 150),
          "probe_memory": (0, 0), "async_checkpoint": (75, 150), "sigkill_resume": (75, 240),
          "memory_tier": (40, 150)}
MIN_PART_S = 10.0  # less than this left of the budget: the part is skipped
TOLERANCE = 1e-3  # relative loss difference allowed after a resume when deterministic algorithms are refused
STALL_FACTOR, STALL_SLACK_S = 1.5, 0.05  # a stall within 1.5 x the copy floor + 50 ms (docs/checkpoint-format.md)
PERSIST_FRACTION = 0.7  # persist at >= 70% of the disk's write bandwidth
MEMORY_MARGIN = 1.10  # the measured peak may exceed the planner's total by 10%
STEPS, SHADOW_STEP, KILL_STEP = 8, 6, 5

# The shapes (Hydra overrides) on a GPU and in the dry run. FIT: the 8b shape, layers set by the planner.
# FSDP: what the two fsdp parts add to FIT: FSDP2 at one rank, bf16 gathered parameters (the 70b recipe's).
# CKPT: one 8b block with the full vocabulary (~15 GB of state). SMALL: one block, 32k vocabulary (~6 GB).
GPU_BASE = {"training.mixed_precision": "bf16", "training.seq_len": 8192, "training.global_batch_size": 1,
            "training.micro_batch_size": 1}
SHAPES = {
    "gpu": {"fit": {"model": "8b", "parallel.activation_checkpoint": "selective", **GPU_BASE},
            "ckpt": {"model": "8b", "model.n_layers": 1, **GPU_BASE},
            "small": {"model": "8b", "model.n_layers": 1, "model.vocab_size": 32768, **GPU_BASE,
                      "training.seq_len": 2048, "training.global_batch_size": 2, "training.micro_batch_size": 2}},
    "dry": {name: {"model": "debug", "training.mixed_precision": "bf16", "training.seq_len": 64,
                   "training.global_batch_size": 4, "training.micro_batch_size": 2}
            for name in ("fit", "ckpt", "small")},
}
FSDP = {"parallel.force_fsdp": "true", "parallel.param_dtype": "bf16"}


class PartTimeout(Exception):
    pass


@dataclass
class Part:
    name: str
    status: str = "skipped"  # pass | fail | skipped
    reason: str = ""
    seconds: float = 0.0
    limit_s: float = 0.0
    results: Dict[str, object] = field(default_factory=dict)


@dataclass
class Check:
    out: Path
    data: Path
    dry_run: bool
    budget_s: float
    shm: Path
    started: float = field(default_factory=time.monotonic)  # main() passes its own start: data prep counts
    env: Dict[str, object] = field(default_factory=dict)
    parts: Dict[str, Part] = field(default_factory=dict)
    fit_layers: Optional[int] = None
    reports: Dict[str, dict] = field(default_factory=dict)  # scripts/instrumented.py's, by part

    @property
    def cuda(self) -> bool:
        return bool(self.env.get("cuda_available"))

    @property
    def device(self) -> str:
        return "cuda" if self.cuda and not self.dry_run else "cpu"

    def shape(self, name: str) -> dict:
        return dict(SHAPES["dry" if self.dry_run else "gpu"][name])

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run(self, cmd: List[str], deadline: float, log: Path, env: Optional[dict] = None):
        """``cmd`` in its own process group, output to ``log``; killed (with everything it started) at ``deadline``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled", **(env or {})},
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                raise PartTimeout(f"{Path(cmd[1]).name if len(cmd) > 1 else cmd[0]} ran past the part's limit")
        return subprocess.CompletedProcess(cmd, rc, log.read_text(), "")

    def train(self, run_dir: Path, shape: dict, extra: dict, deadline: float, steps: int = STEPS,
              deterministic: bool = False, floor_bytes: int = 0, env: Optional[dict] = None, label: str = ""):
        """train.py (through scripts/instrumented.py) with the shape and ``extra``; (process, its report).
        The log and the report are written beside ``run_dir`` as <label or run_dir's name>.log/.json."""
        overrides = self.overrides(run_dir, shape, extra, steps)
        label = label or run_dir.name
        report = run_dir.parent / f"{label}.instrumented.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "instrumented.py"), "train", "--report", str(report),
               "--floor-bytes", str(floor_bytes), *(["--deterministic"] if deterministic else []), "--", *overrides]
        proc = self.run(cmd, deadline, run_dir.parent / f"{label}.log", env)
        return proc, (json.loads(report.read_text()) if report.exists() else {})

    def overrides(self, run_dir: Path, shape: dict, extra: dict, steps: int = STEPS) -> List[str]:
        """train.py's Hydra overrides for a run of ``shape`` with ``extra`` (the planner plans the same)."""
        from rehearsal.runs import debug_overrides

        base = {"parallel.device": self.device, "parallel.dp_shard": 1, "eval.interval": 0, "optim.warmup_steps": 1,
                "recovery.guards.shadow_interval": 0, "logging.peak_tflops": self.peak_tflops}
        return debug_overrides(run_dir, self.data, steps, {**base, **shape, **extra})

    @property
    def peak_tflops(self) -> float:
        from planner.plan import DEFAULT_DEVICE_TFLOPS

        return float(self.env.get("peak_tflops") or DEFAULT_DEVICE_TFLOPS)

    def plan(self, shape: dict, extra: dict):
        """The planner's plan for the config train.py composes from ``shape`` and ``extra``, on this GPU."""
        from planner.plan import Device, plan_from_config
        from rehearsal.supervisor import compose
        from trainer.config import typed

        overrides = self.overrides(self.out / "plan", shape, extra)
        cuda = self.cuda
        device = Device(memory_gib=float(self.env["gpu_memory_gib"]), tflops=self.peak_tflops) if cuda else Device()
        return compose(overrides), device, lambda cfg: plan_from_config(typed(cfg)[0], 1, device=device)


def fail_on(problems: List[str]) -> tuple:
    return ("fail", "; ".join(problems)) if problems else ("pass", "")


def _gib(n) -> Optional[float]:
    return None if n is None else round(n / 2**30, 3)


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-600:]


# --- the parts ------------------------------------------------------------------------------------------------------

def environment(check: Check, deadline: float) -> tuple:
    proc = check.run([sys.executable, str(ROOT / "scripts" / "instrumented.py"), "env"], deadline,
                     check.out / "environment.log")
    if proc.returncode != 0:
        return "fail", f"exit {proc.returncode}: {_tail(proc)}", {}
    check.env = json.loads(proc.stdout.strip().splitlines()[-1])
    if not check.cuda:
        return "pass", "no CUDA device: " + ("the dry run runs the parts on CPU" if check.dry_run
                                            else "the parts that need one are skipped"), check.env
    note = "" if check.env.get("peak_tflops") else f"{check.env['gpu']} is not in the peak table: MFU is not judged"
    return "pass", note, check.env


def cuda_tests(check: Check, deadline: float) -> tuple:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    xml = check.out / "cuda_tests.xml"
    proc = check.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-m", "cuda",
                      f"--junitxml={xml}", *files], deadline, check.out / "cuda_tests.log")
    if not xml.exists():
        return "fail", f"pytest exit {proc.returncode}, no report: {_tail(proc)}", {"files": files}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    results = {"files": files, **counts}
    if counts["failures"] or counts["errors"] or proc.returncode not in (0, 5):
        return "fail", f"{counts['failures']} failed, {counts['errors']} errors: {_tail(proc)}", results
    if not check.cuda:
        return "skipped", f"no CUDA device: pytest skipped all {counts['tests']} tests marked cuda", results
    if counts["skipped"]:
        return "fail", f"{counts['skipped']} of {counts['tests']} cuda tests skipped on a CUDA machine", results
    return "pass", "", results


def _fit_layers(check: Check) -> tuple:
    """The most layers of the 8b shape the planner says fit this device under FSDP2 (a bisection: memory
    grows with every layer)."""
    cfg, device, plan = check.plan(check.shape("fit"), FSDP)

    def fits(n: int) -> bool:
        cfg.model.n_layers = n
        return plan(cfg).fits

    low, high = 0, int(cfg.model.n_layers)  # fits(low) is taken as true, the answer lies in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    if low == 0:
        raise RuntimeError(f"the planner says not even one layer of the 8b shape fits {device.memory_gib:.1f} GiB")
    return low, device


def _fsdp(check: Check, deadline: float, compile_: bool) -> tuple:
    from metrics.records import read_metrics

    if check.fit_layers is None:
        check.fit_layers = _fit_layers(check)[0]
    extra = {**FSDP, "model.n_layers": check.fit_layers, "parallel.compile": str(compile_).lower()}
    if not compile_:
        extra["recovery.guards.shadow_interval"] = SHADOW_STEP  # the probe, mid-run (probe_memory)
    cfg, device, plan_of = check.plan(check.shape("fit"), extra)
    plan = plan_of(cfg)
    name = "fsdp_compile" if compile_ else "fsdp_eager"
    results = {"n_layers": check.fit_layers, "device": check.device, "planned": {
        "for": check.env.get("gpu") or "the planner's H100 defaults (no GPU)",
        "total_gib": _gib(plan.total_bytes_per_rank), "device_memory_gib": round(device.memory_gib, 2),
        "tokens_per_s": round(plan.tokens_per_s_per_device, 1), "mfu": round(plan.mfu, 4), "fits": plan.fits}}
    # Inductor's C++ build takes a minute on CPU: the dry run passes the flag through, with dynamo off.
    env = {"TORCHDYNAMO_DISABLE": "1"} if compile_ and check.dry_run else None
    if env:
        results["note"] = "dry run: TORCHDYNAMO_DISABLE=1 (compile's plumbing, not the compiler)"
    run_dir = check.out / name / "run"
    proc, report = check.train(run_dir, check.shape("fit"), extra, deadline, env=env)
    check.reports[name] = report
    results["fsdp2"] = "FSDP2 on a size-1 mesh" in proc.stdout  # trainer/run.py's start line says so
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 3]  # step 1 compiles and warms up, 2 settles
    if proc.returncode != 0 or not rows:
        return "fail", f"train.py exit {proc.returncode}: {_tail(proc)}", results
    if not results["fsdp2"]:
        return "fail", "train.py ran without the FSDP2 wrapper (parallel.force_fsdp did not take)", results
    peak = report.get("peak_reserved_before_probe")
    results.update(tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in rows), 1),
                   mfu=round(statistics.median(r["mfu"] for r in rows), 4) if check.env.get("peak_tflops") else None,
                   tflops_per_device=round(statistics.median(r["tflops_per_device"] for r in rows), 3),
                   peak_reserved_gib=_gib(peak), peak_reserved_with_probe_gib=_gib(report.get("peak_reserved")))
    if check.device != "cuda":
        return "pass", "CPU: tokens/s and MFU of the CPU; the allocator's peak is not measured here", results
    results["measured_over_planned"] = round(peak / plan.total_bytes_per_rank, 3)
    too_big = results["measured_over_planned"] > MEMORY_MARGIN
    return (*fail_on([f"peak reserved {results['peak_reserved_gib']} GiB > {MEMORY_MARGIN} x the planner's "
                      f"{results['planned']['total_gib']} GiB"] if too_big else []), results)


def fsdp_eager(check: Check, deadline: float) -> tuple:
    return _fsdp(check, deadline, compile_=False)


def fsdp_compile(check: Check, deadline: float) -> tuple:
    return _fsdp(check, deadline, compile_=True)


def probe_memory(check: Check, deadline: float) -> tuple:
    """The probe's peak, from the fsdp_eager run (guards' shadow check) and the async save's manifest."""
    runs = {name: check.reports.get(name, {}).get("probes") for name in ("fsdp_eager", "async_checkpoint")}
    eager = check.reports.get("fsdp_eager", {})
    if not runs["fsdp_eager"]:
        return "skipped", f"the fsdp_eager run did not reach its shadow check at step {SHADOW_STEP}", {}
    first = runs["fsdp_eager"][0]
    results = {"calls": {k: len(v or []) for k, v in runs.items()}, "seconds": round(first["seconds"], 4),
               "device": check.device}
    if first["peak_allocated"] is None:
        return "pass", "CPU: the probe ran; its peak is a CUDA allocator measure, not measured here", results
    results.update(probe_peak_allocated_gib=_gib(first["peak_allocated"]),
                   probe_extra_gib=_gib(first["peak_allocated"] - first["allocated_before"]),
                   training_peak_allocated_gib=_gib(eager.get("peak_allocated_before_probe")),
                   probe_peak_reserved_gib=_gib(first["peak_reserved"]),
                   raises_the_run_peak=first["peak_allocated"] > (eager.get("peak_allocated_before_probe") or 0))
    return "pass", "", results


def _disk_write_floor(directory: Path, nbytes: int) -> dict:
    """Write and fsync ``nbytes`` (at most 2 GiB) in ``directory``: the bandwidth a persist is held to."""
    nbytes = max(1, min(nbytes, 2 * 2**30))
    directory.mkdir(parents=True, exist_ok=True)
    bandwidth = write_floor(directory, nbytes)
    return {"bytes": nbytes, "seconds": nbytes / bandwidth, "gbps": bandwidth / 1e9}


def async_checkpoint(check: Check, deadline: float) -> tuple:
    from metrics.records import read_metrics

    cfg, _, plan_of = check.plan(check.shape("ckpt"), {})
    nbytes = plan_of(cfg).checkpoint_bytes_per_rank
    run_dir = check.out / "async_checkpoint" / "run"
    disk = _disk_write_floor(run_dir.parent, nbytes)
    extra = {"checkpoint.interval": 2, "checkpoint.async_mode": "async", "checkpoint.keep_last": 1}
    try:
        proc, report = check.train(run_dir, check.shape("ckpt"), extra, deadline, steps=4, floor_bytes=nbytes)
        check.reports["async_checkpoint"] = report
        saves = [e for e in read_metrics(run_dir, "checkpoint") if e["committed"]]
        results = {"device": check.device, "disk_write_floor": disk, "copy_floor": report.get("floor")}
        if proc.returncode != 0 or len(saves) < 2:
            return "fail", f"train.py exit {proc.returncode}, {len(saves)} of 2 saves committed: {_tail(proc)}", results
        last = saves[-1]  # the steady state: the first save also allocates the pinned buffers
        floor_s = last["bytes"] / (report["floor"]["gbps"] * 1e9)
        results.update(bytes=last["bytes"], stall_s=round(last["blocking_s"], 4), copy_floor_s=round(floor_s, 4),
                       first_stall_s=round(saves[0]["blocking_s"], 4), persist_s=round(last["background_s"], 3),
                       persist_gbps=round(last["bytes"] / last["background_s"] / 1e9, 3),
                       disk_write_gbps=round(disk["gbps"], 3))
        # resume at the last step: load and verify (the probe again), no training
        load, _ = check.train(run_dir, check.shape("ckpt"), extra, deadline, steps=4, label="load")
        resumed = read_metrics(run_dir, "resume")
        verified = "post-load verification of step_00000004 passed" in load.stdout
        results.update(load_s=resumed[-1]["load_s"] if resumed else None, verified=verified)
        problems = [] if load.returncode == 0 and verified else [f"the load did not verify: {_tail(load)}"]
        if check.device != "cuda":
            return (*fail_on(problems), results) if problems else \
                ("pass", "CPU: tiny state, the stall and persist targets are judged on a GPU only", results)
        if last["blocking_s"] > STALL_FACTOR * floor_s + STALL_SLACK_S:
            problems.append(f"stall {last['blocking_s']:.3f} s > {STALL_FACTOR} x the copy floor {floor_s:.3f} s")
        if results["persist_gbps"] < PERSIST_FRACTION * disk["gbps"]:
            problems.append(f"persist {results['persist_gbps']} GB/s < {PERSIST_FRACTION} x the disk's "
                            f"{disk['gbps']:.2f} GB/s")
        return (*fail_on(problems), results)
    finally:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def sigkill_resume(check: Check, deadline: float) -> tuple:
    """An uninterrupted run, then one SIGKILLed at step KILL_STEP and run again: the same losses."""
    from metrics.records import read_metrics, step_losses
    from rehearsal.chains import divergences, faults_override

    root = check.out / "sigkill_resume"
    extra = {"checkpoint.interval": 2, "checkpoint.async_mode": "async", "checkpoint.keep_last": 1}
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": KILL_STEP}]).split("=", 1)[1]
    notes = []
    try:
        for deterministic, rtol in ((True, 0.0), (False, TOLERANCE)):
            tag = "deterministic" if deterministic else "tolerance"
            base, _ = check.train(root / f"{tag}-baseline", check.shape("small"), extra, deadline, 6,
                                  deterministic=deterministic)
            if base.returncode != 0 and deterministic and "deterministic" in base.stdout:
                notes.append(f"deterministic algorithms refused: {_tail(base)}")
                continue
            if base.returncode != 0:
                return "fail", f"the uninterrupted run failed: {_tail(base)}", {"notes": notes}
            run_dir = root / f"{tag}-killed"
            faults = {**extra, "recovery.faults": kill}
            killed, _ = check.train(run_dir, check.shape("small"), faults, deadline, 6, deterministic=deterministic)
            again, _ = check.train(run_dir, check.shape("small"), faults, deadline, 6, deterministic=deterministic,
                                   label=f"{tag}-resumed")
            resumed = read_metrics(run_dir, "resume")
            results = {"device": check.device, "mode": tag, "rtol": rtol, "killed_returncode": killed.returncode,
                       "resumed_from": resumed[-1]["checkpoint_id"] if resumed else None, "notes": notes,
                       "divergences": divergences(step_losses(root / f"{tag}-baseline"), run_dir, rtol)[:5]}
            problems = [] if killed.returncode == -signal.SIGKILL else [f"the kill run exited {killed.returncode}"]
            problems += [] if again.returncode == 0 and resumed else [f"the rerun did not resume: {_tail(again)}"]
            problems += [f"losses differ ({tag}): {results['divergences']}"] if results["divergences"] else []
            return (*fail_on(problems), results)
        return "fail", "neither run could start", {"notes": notes}
    finally:
        for ckpt in root.glob("*/checkpoints"):
            shutil.rmtree(ckpt, ignore_errors=True)


def memory_tier(check: Check, deadline: float) -> tuple:
    from metrics.records import read_metrics

    cfg, _, plan_of = check.plan(check.shape("small"), {})
    nbytes = plan_of(cfg).checkpoint_bytes_per_rank
    check.shm.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(check.shm).free
    if free < 2 * nbytes:
        return "skipped", f"{check.shm} has {free / 2**30:.1f} GiB free; 2 snapshots need {2 * nbytes / 2**30:.1f}", {}
    shm = check.shm / f"gpu_check-{os.getpid()}"
    run_dir = check.out / "memory_tier" / "run"
    extra = {"checkpoint.interval": 0, "checkpoint.memory.interval": 2, "checkpoint.memory.replicas": 0,
             "checkpoint.memory.root": str(shm)}
    try:
        proc, report = check.train(run_dir, check.shape("small"), extra, deadline, 6, floor_bytes=nbytes)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    snaps = [e for e in read_metrics(run_dir, "memory_snapshot") if e["committed"]]
    results = {"device": check.device, "copy_floor": report.get("floor"), "snapshots": len(snaps)}
    if proc.returncode != 0 or len(snaps) < 2:
        return "fail", f"train.py exit {proc.returncode}, {len(snaps)} snapshots complete: {_tail(proc)}", results
    stall = statistics.median(e["stall_s"] for e in snaps[1:])  # the first also allocates its buffers
    floor_s = snaps[-1]["bytes"] / (report["floor"]["gbps"] * 1e9)
    results.update(bytes=snaps[-1]["bytes"], stall_s=stall, first_stall_s=snaps[0]["stall_s"],
                   copy_floor_s=round(floor_s, 4))
    if check.device != "cuda":
        return "pass", "CPU: tiny state, the stall target is judged on a GPU only", results
    return (*fail_on([f"stall {stall:.3f} s > {STALL_FACTOR} x the copy floor {floor_s:.3f} s"]
                     if stall > STALL_FACTOR * floor_s + STALL_SLACK_S else []), results)


PARTS: Dict[str, Callable[[Check, float], tuple]] = {
    "environment": environment, "cuda_tests": cuda_tests, "fsdp_eager": fsdp_eager, "fsdp_compile": fsdp_compile,
    "async_checkpoint": async_checkpoint, "probe_memory": probe_memory, "sigkill_resume": sigkill_resume,
    "memory_tier": memory_tier}  # in this order: probe_memory reads the two runs before it
GPU_ONLY = ("fsdp_eager", "fsdp_compile", "probe_memory", "async_checkpoint", "sigkill_resume", "memory_tier")


def run_part(check: Check, name: str) -> Part:
    part = Part(name, limit_s=min(LIMITS[name][1 if check.dry_run else 0], max(0.0, check.remaining())))
    if name in GPU_ONLY and not check.dry_run and not check.cuda:
        part.reason = "no CUDA device (the environment part says why); --dry-run runs it on CPU"
        return part
    if LIMITS[name][0] and part.limit_s <= MIN_PART_S:
        part.reason = f"the {check.budget_s:.0f} s budget is spent ({check.remaining():.0f} s left)"
        return part
    t0 = time.monotonic()
    try:
        part.status, part.reason, part.results = PARTS[name](check, t0 + part.limit_s)
    except PartTimeout as exc:
        part.status, part.reason = "fail", f"over its {part.limit_s:g} s limit: {exc}"
    except Exception as exc:  # recorded; the next part still runs
        part.status, part.reason = "fail", f"{type(exc).__name__}: {exc}"
        part.results["traceback"] = traceback.format_exc()[-3000:]
    part.seconds = round(time.monotonic() - t0, 2)
    return part


def markdown(check: Check, parts: List[Part]) -> str:
    env = check.env
    lines = [f"# GPU check{' (dry run, CPU)' if check.dry_run else ''}", "",
             f"{env.get('gpu', 'no GPU')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}; "
             f"{time.monotonic() - check.started:.0f} s of a {check.budget_s:.0f} s budget.", "",
             "| part | status | seconds (limit) | reason |", "|---|---|---|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:g} ({p.limit_s:.0f}) | {p.reason.replace('|', '/')} |"
              for p in parts]
    for p in parts:
        shown = {k: v for k, v in p.results.items() if k != "traceback"}
        if shown:
            lines += ["", f"## {p.name}", "", "```", json.dumps(shown, indent=1, default=str), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the same code paths in seconds")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default outputs/gpu_check/<time>)")
    parser.add_argument("--data", type=Path, default=None, help="the debug experiment's data (built if missing)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole check's seconds (default {BUDGET_S:g}; {DRY_BUDGET_S:g} for --dry-run)")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs for the memory tier")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_BUDGET_S if args.dry_run else BUDGET_S
    from rehearsal.runs import prepare_debug_data

    started = time.monotonic()  # the budget covers everything from here, data preparation included
    out = (args.out or ROOT / "outputs" / "gpu_check" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu check: report folder {out}", flush=True)
    data = prepare_debug_data(args.data or out / "data")
    data_s = round(time.monotonic() - started, 1)
    check = Check(out=out, data=Path(data).resolve(), dry_run=args.dry_run, budget_s=args.budget_s, shm=args.shm,
                  started=started)
    parts = []
    for name in PARTS:
        parts.append(run_part(check, name))
        p = parts[-1]
        print(f"  {p.name:<17} {p.status:<8} {p.seconds:7.1f} s  {p.reason[:150]}", flush=True)
    report = {"dry_run": args.dry_run, "budget_s": args.budget_s, "environment": check.env,
              "seconds": round(time.monotonic() - check.started, 1), "data_preparation_s": data_s,
              "parts": [p.__dict__ for p in parts]}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(check, parts))
    print(f"gpu check: {out / 'report.md'} and report.json", flush=True)
    return 1 if any(p.status == "fail" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
