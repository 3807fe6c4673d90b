"""checkpoint.async_mode=async_process: DCP plans and writes in a writer process of each rank.

The checkpoints must be the thread writer's (same files, committed, verified at load, bitwise
resume), and the writer processes must not outlive their rank, also when the rank is SIGKILLed."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from checkpoint.durable.discovery import list_checkpoints
from checkpoint.durable.manifest import read_manifest
from checkpoint.interop.export import load_tensors
from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run, run_train, torchrun, worker

pytestmark = pytest.mark.distributed

STEPS, INTERVAL = 8, 4


def _processes_with(mark: str) -> list:
    """Pids of live processes whose environment holds ``mark`` (a run's own variable)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in env and state != "Z":
            found.append(int(pid))
    return found


def _run(run_dir: Path, data: Path, mode: str, *extra: str, check: bool = True):
    mark = f"LLM_TEST_RUN={uuid.uuid4().hex}"
    proc = run_train(tiny_overrides(run_dir, data, STEPS, INTERVAL, keep_last=3, async_mode=mode, extra=list(extra)),
                     nproc=2, check=check, extra_env=dict([mark.split("=")]))
    deadline = time.monotonic() + 20  # a writer whose rank died sees its pipe close and exits
    while _processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(mark) == [], "a checkpoint writer process outlived its rank"
    return proc


@pytest.fixture(scope="module")
def thread(tmp_path_factory, pydoc_data) -> Path:
    """The same run with the writer thread (checkpoint.async_mode=async)."""
    run_dir = tmp_path_factory.mktemp("async") / "thread"
    _run(run_dir, pydoc_data, "async")
    return run_dir


def test_the_writer_process_saves_what_the_writer_thread_saves(thread, tmp_path, pydoc_data):
    process = tmp_path / "process"
    _run(process, pydoc_data, "async_process")
    assert step_losses(process) == step_losses(thread)
    saves = read_metrics(process, "checkpoint")
    assert [(s["step"], s["mode"], s["committed"]) for s in saves] == [(4, "async_process", True),
                                                                      (8, "async_process", True)]
    for step in (4, 8):
        a, b = (read_manifest(d / "checkpoints" / f"step_{step:08d}") for d in (thread, process))
        assert set(b.files) == set(a.files) and all(v.checksum for v in b.files.values())  # checksummed on ack
        for prefix in ("model.", "optim."):  # the same tensors, bit for bit (verified against the checksums)
            x, y = (load_tensors(d / "checkpoints" / f"step_{step:08d}", prefix) for d in (thread, process))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # resumed from step 4 with the writer process: steps 5..8 bitwise those of the uninterrupted run
    _run(process, pydoc_data, "async_process", "checkpoint.resume=4")
    assert read_metrics(process, "resume")[-1]["checkpoint_id"] == "step_00000004"
    assert step_losses(process) == step_losses(thread)


def test_a_killed_rank_leaves_no_writer_process_and_resumes(thread, tmp_path, pydoc_data):
    run_dir = tmp_path / "killed"
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": 6, "rank": 1}])
    killed = _run(run_dir, pydoc_data, "async_process", kill, check=False)
    assert killed.returncode != 0
    committed = [c.checkpoint_id for c in list_checkpoints(run_dir / "checkpoints") if c.committed]
    assert committed in ([], ["step_00000004"])  # step 4's write may still have been in flight at the kill
    _run(run_dir, pydoc_data, "async_process", kill)  # resume=auto; the fault already fired
    assert step_losses(run_dir) == step_losses(thread)


def test_the_staging_buffers_stay_where_they_were_allocated(tmp_path):
    """Sending the staged dict to the writer process must not move it into /dev/shm (in place of pinned
    buffers, uncounted): the stager allocates shared buffers once; after two saves they are the same
    storages (tests/support/workers/staging_worker.py)."""
    proc = run(torchrun(2, worker("staging_worker"), str(tmp_path)), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
