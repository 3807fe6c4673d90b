"""Fault injection fires exactly where and once as configured; corruption kinds damage
real files; preemption signals are agreed on."""

from __future__ import annotations

import math
import os
import signal
import sys

import pytest
import torch

from recovery.config import FaultConfig as Fault
from recovery.faults import FaultInjector, InjectedFault, corrupt_checkpoint
from recovery.runtime import Preemption
from support.launch import run, torchrun, worker


def test_exception_fires_once_at_its_step_and_phase(tmp_path):
    inj = FaultInjector([Fault("exception", "step", step=3)], tmp_path, rank=0)
    inj.maybe_inject("step", 2)
    inj.maybe_inject("data_wait", 3)
    with pytest.raises(InjectedFault, match="step 3"):
        inj.maybe_inject("step", 3)
    inj.maybe_inject("step", 3)  # already fired in this run directory: the restarted job passes
    again = FaultInjector([Fault("exception", "step", step=3)], tmp_path, rank=0)
    again.maybe_inject("step", 3)  # a new process on the same run dir: still fired


def test_other_rank_and_defaults_do_nothing(tmp_path):
    FaultInjector([Fault("exception", "step", step=1, rank=1)], tmp_path, rank=0).maybe_inject("step", 1)
    FaultInjector([], tmp_path, 0).maybe_inject("step", 1)
    assert not (tmp_path / "faults").exists()


def test_invalid_fault_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kind='explode'"):
        FaultInjector([Fault("explode", "step")], tmp_path, 0)
    with pytest.raises(ValueError, match="phase='lunch'"):
        FaultInjector([Fault("sigkill", "lunch")], tmp_path, 0)
    with pytest.raises(ValueError, match="checkpoint_committed"):
        FaultInjector([Fault("corrupt", "step")], tmp_path, 0)


def test_nan_loss_poisons_the_forward(tmp_path):
    model = torch.nn.Linear(4, 2)
    FaultInjector([{"kind": "nan_loss", "phase": "step", "step": 2}], tmp_path, 0).maybe_inject("step", 2, model=model)
    assert math.isnan(model(torch.ones(1, 4)).sum().item())


def test_sigkill_kills_the_real_process_and_stays_fired(tmp_path):
    cmd = [sys.executable, worker("fault_sigkill"), str(tmp_path)]
    first = run(cmd, timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split() == ["survived", "1", "survived", "2", "survived", "3"]
    second = run(cmd, timeout=60)
    assert second.returncode == 0 and second.stdout.count("survived") == 6


def _fake_checkpoint(path):
    path.mkdir()
    (path / "manifest.json").write_text('{"step": 1}')
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (path / ".metadata").write_bytes(b"m" * 100)
    return path


@pytest.mark.parametrize("how", ["truncate", "flip_byte", "delete_file", "delete_manifest"])
def test_corruptions_damage_the_checkpoint(tmp_path, how):
    ckpt = _fake_checkpoint(tmp_path / "step-1")
    before = (ckpt / "__0_0.distcp").read_bytes()
    what = corrupt_checkpoint(ckpt, how)
    data = ckpt / "__0_0.distcp"
    if how == "truncate":
        assert data.stat().st_size == len(before) // 2
    elif how == "flip_byte":
        after = data.read_bytes()
        assert len(after) == len(before) and sum(a != b for a, b in zip(after, before)) == 1
    elif how == "delete_file":
        assert not data.exists() and (ckpt / "manifest.json").exists()
    else:
        assert not (ckpt / "manifest.json").exists() and data.exists()
    assert what


def test_preemption_flag_set_by_signal_only():
    pre = Preemption(["SIGUSR1"], grace_s=5.0).install()
    try:
        assert not pre.agree()[0]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.agree()[0] and pre.signal_name == "SIGUSR1"
        assert 0 < pre.seconds_left() <= 5.0
    finally:
        pre.uninstall()


@pytest.mark.distributed
def test_preemption_is_agreed_by_all_ranks():
    """Only rank 1 is signalled; both ranks stop at the same step boundary."""
    proc = run(torchrun(2, worker("preemption_ranks")), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stops = sorted(line for line in proc.stdout.splitlines() if line.startswith("STOP"))
    assert stops == ["STOP 0 4 peer", "STOP 1 4 SIGUSR1"]
