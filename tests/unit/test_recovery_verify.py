"""Post-load verification rules, one at a time: step, LR against the schedule, probe loss
(bitwise at the same layout, a tolerance after resharding), global batch, fallback depth."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from checkpoint.durable.discovery import mark_bad
from checkpoint.durable.manifest import ConfigMismatch, Manifest, write_manifest
from checkpoint.state.fingerprint import config_hash, hashed_config
from checkpoint.storage import location
from recovery.verify import RecoveryError, ResumeVerifier, probe_matches, refuse_all_bad
from training.schedule import build_scheduler, schedule_lr

LAYOUT = {"dp_replicate": 1, "dp_shard": 1, "tp": 1}
KERNELS = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "12.8", "cudnn": 91000, "nccl": "2.27.5",
           "deterministic": False}  # recovery/probe.py kernel_identity, as a GPU run records it


class _Probe:
    """A probe returning ``value``, computed on ``kernels`` (recovery/probe.py Probe's attributes)."""

    method = "per-sequence-float64-sum"
    methods = (method,)

    def __init__(self, value, kernels=KERNELS):
        self.value, self.kernels = value, kernels

    def __call__(self):
        return self.value

    def value_for(self, method, samples):
        return self.value


def _cfg(root, **recovery):
    rc = {"verify": True, "probe_rtol_reshard": 1e-4, "max_fallbacks": 3, "allow_global_batch_change": False,
          "read_retries": 0, "read_retry_backoff_s": 0.0}
    rc.update(recovery)
    return OmegaConf.create({
        "optim": {"lr": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
        "training": {"steps": 10, "global_batch_size": 8, "mixed_precision": "fp32"},
        "checkpoint": {"dir": str(root)}, "recovery": rc})


def _hash(cfg) -> str:
    return config_hash(hashed_config(OmegaConf.to_container(cfg)))


def _verifier(cfg, state, probe, layout, world_size):
    """The run's verifier: its sections, and the manager's directory, retries, config hash and global batch."""
    rc = cfg.recovery
    ckpt = SimpleNamespace(root=location(cfg.checkpoint.dir), retries=(rc.read_retries, rc.read_retry_backoff_s),
                           config_hash=_hash(cfg), global_batch_size=cfg.training.global_batch_size)
    return ResumeVerifier(rc, cfg.optim, cfg.training.steps, ckpt, state, probe, layout, world_size)


def _state(cfg, step):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    sched = build_scheduler(opt, cfg.optim, cfg.training.steps)
    for _ in range(step):
        opt.step()
        sched.step()
    return SimpleNamespace(step=step, optimizer=opt, rank=0)


def _manifest(step, probe=2.5, world=1, layout=LAYOUT, gbs=8, cfg=None, kernels=KERNELS):
    """A manifest saved with ``cfg``'s hashed settings (default: those of _cfg), or "x" if cfg is False,
    its probe computed by _Probe's method on ``kernels``."""
    hashed = _hash(cfg or _cfg("unused")) if cfg is not False else "x"
    return Manifest(checkpoint_id=f"step_{step:08d}", step=step, tokens=0, samples=0, created_at=0.0,
                    config_hash=hashed, config={}, world_size=world, layout=dict(layout), global_batch_size=gbs,
                    loss=None, probe_loss=probe, checksum_algorithm=None, probe_method=_Probe.method,
                    probe_kernels=kernels)


def _committed(root, step):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    write_manifest(d, _manifest(step))
    return d


def test_a_good_checkpoint_passes(tmp_path):
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    v = _verifier(cfg, _state(cfg, 4), probe=_Probe(2.5), layout=LAYOUT, world_size=1)
    assert v(_manifest(4), path) is None
    assert v.report["lr"] == schedule_lr(cfg.optim, 10, 4)


def test_step_and_probe_mismatches_are_named(tmp_path):
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    state = _state(cfg, 3)  # restored one step short: the bytes disagree with the manifest
    problem = _verifier(cfg, state, probe=_Probe(2.5000001), layout=LAYOUT, world_size=1)(_manifest(4), path)
    assert "restored step 3 != manifest step 4" in problem
    assert "probe loss 2.5000001 != stored 2.5 (bitwise (same layout))" in problem


def test_an_lr_mismatch_is_a_bug_not_a_bad_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    state = _state(cfg, 4)
    state.optimizer.param_groups[0]["lr"] *= 2  # the config's schedule was not applied at load
    with pytest.raises(RecoveryError, match="not marked bad"):
        _verifier(cfg, state, probe=_Probe(2.5), layout=LAYOUT, world_size=1)(_manifest(4), path)


def test_after_an_allowed_config_change_the_probe_is_only_logged(tmp_path):
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    before = _cfg(tmp_path)
    before.training.mixed_precision = "bf16"  # saved under another precision, resumed with the change allowed
    v = _verifier(cfg, _state(cfg, 4), probe=_Probe(2.51), layout=LAYOUT, world_size=1)
    assert v(_manifest(4, cfg=before), path) is None
    assert v(_manifest(4, probe=2.5), path) is not None  # unchanged config: the same difference is bad bytes


def test_probe_rule_is_bitwise_at_same_layout_and_tolerant_after_resharding():
    assert probe_matches(2.5, 2.5, True, 1e-4) and not probe_matches(2.5, 2.5 + 1e-12, True, 1e-4)
    assert probe_matches(2.5, 2.5 * (1 + 5e-5), False, 1e-4) and not probe_matches(2.5, 2.5 * 1.001, False, 1e-4)
    assert not probe_matches(float("nan"), float("nan"), True, 1e-4)


def test_resharded_resume_uses_the_tolerance(tmp_path):
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    v = _verifier(cfg, _state(cfg, 4), probe=_Probe(2.5 * (1 + 3e-7)), layout=LAYOUT, world_size=1)
    assert v(_manifest(4, world=2, layout={"dp_replicate": 1, "dp_shard": 2, "tp": 1}), path) is None


def test_a_probe_from_another_device_or_kernels_uses_the_tolerance(tmp_path, caplog):
    """A restart on another GPU type, torch, CUDA, cuDNN or NCCL (one node of a job on another NCCL: its
    ranks compare with rank 0's stored probe) picks other kernels: the same weights give a probe loss a
    few ulps away. Bitwise only where the manifest's kernel identity is this run's; an
    older manifest without one is compared with the tolerance too."""
    cfg = _cfg(tmp_path)
    path = _committed(tmp_path, 4)
    near = 2.5 * (1 + 3e-7)
    other = {**KERNELS, "device": "NVIDIA A100-SXM4-80GB"}
    for kernels in (other, {**KERNELS, "cudnn": 90100}, {**KERNELS, "torch": "2.12.1"}, {**KERNELS, "nccl": "2.21.5"},
                    None):
        v = _verifier(cfg, _state(cfg, 4), probe=_Probe(near), layout=LAYOUT, world_size=1)
        with caplog.at_level("INFO", logger="trainer"):
            assert v(_manifest(4, kernels=kernels), path) is None, kernels
        assert "~= (other device or kernels)" in caplog.text
    v = _verifier(cfg, _state(cfg, 4), probe=_Probe(near), layout=LAYOUT, world_size=1)
    assert "(bitwise (same layout))" in v(_manifest(4), path)  # the same kernels: the ulps are damage
    v = _verifier(cfg, _state(cfg, 4), probe=_Probe(2.5 * 1.001, other), layout=LAYOUT, world_size=1)
    assert f"(rtol {cfg.recovery.probe_rtol_reshard})" in v(_manifest(4), path)  # beyond the tolerance


def test_a_different_global_batch_is_refused_unless_allowed(tmp_path):
    path = _committed(tmp_path, 4)
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigMismatch, match="global_batch_size=16, this run has 8"):
        _verifier(cfg, _state(cfg, 4), _Probe(2.5), LAYOUT, 1)(_manifest(4, gbs=16), path)
    cfg = _cfg(tmp_path, allow_global_batch_change=True)
    assert _verifier(cfg, _state(cfg, 4), _Probe(2.5), LAYOUT, 1)(_manifest(4, gbs=16), path) is None


def test_fallback_depth_is_bounded(tmp_path):
    cfg = _cfg(tmp_path, max_fallbacks=1)
    oldest = _committed(tmp_path, 2)
    for s in (4, 6):
        mark_bad(_committed(tmp_path, s), "test")
    with pytest.raises(RecoveryError, match=r"2 newer checkpoints failed \(step_00000006 \(test\), "
                                            r"step_00000004 \(test\)\), more than recovery.max_fallbacks=1"):
        _verifier(cfg, _state(cfg, 2), _Probe(2.5), LAYOUT, 1)(_manifest(2), oldest)


def test_all_bad_refuses_a_fresh_start(tmp_path):
    refuse_all_bad(tmp_path)  # empty: a fresh start is fine
    mark_bad(_committed(tmp_path, 2), "flipped byte")
    with pytest.raises(RecoveryError, match=r"every committed checkpoint .* \(step_00000002: flipped byte\)"):
        refuse_all_bad(tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_identity_records_the_nccl_build():
    from recovery.probe import kernel_identity

    assert kernel_identity(torch.device("cuda"))["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))


def test_a_cpu_kernel_identity_names_no_gpu_stack():
    from recovery.probe import kernel_identity

    found = kernel_identity(torch.device("cpu"))
    assert found["device"].startswith("cpu ") and found["cuda"] is found["cudnn"] is found["nccl"] is None
