"""Guards in real training runs: a flipped bit is caught, never becomes the newest verified
checkpoint, and rollback resumes from a clean one."""

import json
import math

import pytest

from metrics.records import read_metrics
from rehearsal.runs import debug_overrides
from support.launch import run_train

pytestmark = pytest.mark.distributed  # every test trains through train.py (one with torchrun)


def _manifests(run_dir):
    out = {}
    for d in sorted((run_dir / "checkpoints").glob("step_*")):
        if (d / "manifest.json").is_file() and "." not in d.name:
            m = json.loads((d / "manifest.json").read_text())
            out[m["step"]] = m
    return out


def _overrides(run_dir, data, action, fault_kind, fault_phase, fault_step, steps=16, **extra):
    return debug_overrides(run_dir, data, steps=steps, extra={
        "checkpoint.interval": 4, "checkpoint.keep_last": 2, "recovery.guards.action": action,
        "recovery.guards.warmup_steps": 4, "recovery.guards.shadow_interval": 2,
        "+recovery.faults": f"[{{kind: {fault_kind}, phase: {fault_phase}, step: {fault_step}, rank: 0}}]",
        **extra,
    })


def test_parameter_bit_flip_rolls_back_to_the_newest_verified_checkpoint(pydoc_data, tmp_path):
    run_dir = tmp_path / "flip-param"
    proc = run_train(_overrides(run_dir, pydoc_data, "rollback", "bitflip_param", "step", 10))
    alarms = read_metrics(run_dir, "alarm")
    assert alarms and alarms[0]["step"] == 10, alarms  # caught in the step the bit flipped
    assert (run_dir / "alarms" / "step00000010-grad_norm.json").is_file()
    rollback = read_metrics(run_dir, "rollback")
    assert len(rollback) == 1 and rollback[0]["to_step"] == 8 and rollback[0]["skipped_samples"] == 2 * 8
    steps = read_metrics(run_dir)
    assert steps[-1]["step"] == 16 and all(math.isfinite(r["loss"]) for r in steps)
    manifests = _manifests(run_dir)
    assert manifests and all(m["verified"] for m in manifests.values())  # no corrupt state was ever saved
    assert "rolled back from step 10 to verified checkpoint step_00000008" in proc.stderr


def test_corrupt_state_never_becomes_the_newest_verified_checkpoint(pydoc_data, tmp_path):
    """block_verified trains on with the corrupt weights (here even through NaN losses): its saves
    are marked unverified, so the newest verified checkpoint stays the clean one before the flip."""
    run_dir = tmp_path / "flip-block"
    run_train(_overrides(run_dir, pydoc_data, "block_verified", "bitflip_param", "step", 10, steps=12,
                         **{"recovery.halt_on_nonfinite_loss": "false"}))
    assert read_metrics(run_dir, "alarm")[0]["step"] == 10
    manifests = _manifests(run_dir)
    assert manifests[12]["verified"] is False and "step 10" in manifests[12]["unverified_reason"]
    newest_verified = max(s for s, m in manifests.items() if m["verified"])
    assert newest_verified == 8


def test_gradient_bit_flip_skips_one_update(pydoc_data, tmp_path):
    run_dir = tmp_path / "flip-grad"
    run_train(_overrides(run_dir, pydoc_data, "skip_step", "bitflip_grad", "gradients", 6, steps=12))
    alarms = read_metrics(run_dir, "alarm")
    assert [a["step"] for a in alarms] == [6] and alarms[0]["action"] == "skip_step"
    assert read_metrics(run_dir, "rollback") == []
    manifests = _manifests(run_dir)
    assert manifests[8]["verified"] is False and manifests[12]["verified"] is True
    assert all(math.isfinite(r["loss"]) for r in read_metrics(run_dir))


def test_cross_replica_check_names_the_diverged_replicas(pydoc_data, tmp_path):
    """A small flip (bit 20: the weight changes by a few percent, too little for the gradient
    test) on one replica of dp_replicate=2 is caught by the weight fingerprint check."""
    run_dir = tmp_path / "replica"
    run_train(_overrides(run_dir, pydoc_data, "block_verified", "bitflip_param", "step", 5, steps=8, **{
        "parallel.dp_replicate": 2, "parallel.dp_shard": 1, "recovery.guards.replica_interval": 2,
        "+recovery.faults": "[{kind: bitflip_param, phase: step, step: 5, rank: 1, bit: 20}]"}), nproc=2)
    alarms = read_metrics(run_dir, "alarm")
    assert alarms and alarms[0]["step"] == 6 and alarms[0]["check"] == "replica", alarms
    assert "all 2 replicas [0, 1] disagree" in alarms[0]["detail"]
    manifests = _manifests(run_dir)
    assert manifests[4]["verified"] is True and manifests[8]["verified"] is False
