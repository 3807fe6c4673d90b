"""Silent-corruption guards: detectors, per-layer norms, replica fingerprints, actions."""

import math
import struct
from types import SimpleNamespace

import pytest
import torch

from model.config import ModelConfig
from model.llama import build_model
from recovery.guards.guard import (
    RatioToRunningMean,
    RobustSpike,
    RollbackRequested,
    TrainingGuards,
    disagreeing_replicas,
    param_fingerprint,
)
from training.grad_stats import layer_grad_norms, layer_groups

CPU = torch.device("cpu")


def guards_cfg(**kw):
    base = dict(enabled=True, action="skip_step", grad_norm_multiple=10.0, warmup_steps=5, loss_spike_k=6.0,
                loss_spike_rel=0.5, loss_window=50, shadow_interval=1, shadow_rel=0.25, shadow_window=8,
                replica_interval=0, max_consecutive_skips=3)
    base.update(kw)
    return SimpleNamespace(**base)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of the fp32 value at flat ``index`` (as a cosmic ray would)."""
    flat = t.data.view(-1)
    word = struct.unpack("<I", struct.pack("<f", float(flat[index])))[0] ^ (1 << bit)
    flat[index] = struct.unpack("<f", struct.pack("<I", word))[0]


def test_ratio_detector_ignores_warmup_and_drift_and_catches_jumps():
    d = RatioToRunningMean(multiple=10, warmup=3)
    assert d.update({"a": 100.0}) == []  # wild start is tolerated during warmup
    for v in [5.0, 4.0, 4.5, 4.0, 3.8, 3.9]:
        assert d.update({"a": v}) == []
    mean_before = d.mean["a"]
    found = d.update({"a": 3e6})
    assert len(found) == 1 and found[0].source == "grad_norm/a"
    assert d.mean["a"] == mean_before  # the spike was not folded into the running mean
    assert d.update({"a": float("nan")})[0].reason == "not finite"


def test_robust_spike_needs_a_real_jump():
    d = RobustSpike("loss", k=6, rel=0.5, window=20, warmup=5)
    healthy = [3.0 - 0.01 * i + 0.02 * math.sin(i) for i in range(40)]
    assert all(d.update(x) is None for x in healthy)  # decreasing, noisy loss: no alarm
    assert d.update(2.8) is None
    alarm = d.update(9.0)
    assert alarm is not None and alarm.source == "loss" and alarm.threshold < 9.0
    assert d.update(float("inf")).reason == "not finite"


def test_layer_norms_match_the_total_norm():
    model = build_model(ModelConfig(), seed=0)
    tokens = torch.randint(0, 320, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    groups = layer_groups(model)
    assert list(groups) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    norms = layer_grad_norms(groups, CPU)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert math.sqrt(sum(v * v for v in norms.values())) == pytest.approx(total.item(), rel=1e-6)


def test_fingerprint_sees_a_single_bit_flip():
    model = build_model(ModelConfig(), seed=0)
    before = int(param_fingerprint(model, CPU))
    flip_bit(model.layers["1"].feed_forward.w2.weight, 17, 3)  # a low mantissa bit: tiny change
    assert int(param_fingerprint(model, CPU)) != before


@pytest.mark.parametrize("prints, bad", [([5, 5, 5], []), ([5, 9, 5], [1]), ([5, 9], [0, 1]),
                                         ([1, 2, 3, 3], [0, 1, 2, 3])])
def test_disagreeing_replicas_by_majority(prints, bad):
    assert disagreeing_replicas(prints) == bad


def _train_with_guards(cfg, corrupt_at=None, steps=30, shadow=True):
    torch.manual_seed(0)
    model = build_model(ModelConfig(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 320, (8, 33), generator=torch.Generator().manual_seed(0))
    shadow_fn = (lambda: torch.nn.functional.cross_entropy(
        model(data[:2, :-1]).flatten(0, 1), data[:2, 1:].flatten()).item()) if shadow else None
    guards = TrainingGuards(cfg, model, CPU, run_dir="/nonexistent-unused", rank=1, shadow_loss=shadow_fn)
    events = []
    for step in range(1, steps + 1):
        if step == corrupt_at:
            flip_bit(model.layers["0"].attention.wq.weight, 5, 30)  # exponent bit: value x 2^128
        loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        if guards.allow_update(step, loss.item()):
            opt.step()
        else:
            events.append(("skip", step))
        opt.zero_grad()
        try:
            guards.after_update(step)
        except RollbackRequested as exc:
            events.append(("rollback", exc.step))
            break
    return guards, events


def test_healthy_training_raises_no_alarm():
    guards, events = _train_with_guards(guards_cfg())
    assert events == [] and guards.raised == [] and guards.take_verified_block() is None


def test_parameter_bit_flip_is_caught_and_escalates_to_rollback():
    guards, events = _train_with_guards(guards_cfg(), corrupt_at=15)
    assert guards.raised and guards.raised[0].step == 15
    # The weights are wrong, so skipping updates cannot help: after max_consecutive_skips
    # skipped steps the guard escalates to a rollback.
    assert events == [("skip", 15), ("skip", 16), ("skip", 17), ("rollback", 17)]
    assert "step 15" in guards.take_verified_block()


def test_log_action_only_records():
    guards, events = _train_with_guards(guards_cfg(action="log"), corrupt_at=15, shadow=False)
    assert events == [] and guards.raised
    assert guards.take_verified_block() is None


def test_unknown_action_is_named():
    with pytest.raises(ValueError, match="recovery.guards.action='ignore'"):
        TrainingGuards(guards_cfg(action="ignore"), build_model(ModelConfig(), seed=0), CPU, "/x", 0)


def test_retention_keeps_the_newest_verified_checkpoint_for_rollback():
    from checkpoint.durable.discovery import Candidate, retention_plan

    cands = [Candidate(4), Candidate(8), Candidate(12, verified=False), Candidate(16, verified=False)]
    plan = retention_plan(cands, keep_last=2)
    assert plan[16] == ["rolling"] and plan[12] == ["rolling"]
    assert plan[8] == ["verified"] and plan[4] == []
    assert retention_plan(cands[:2], keep_last=1)[4] == []  # a kept verified one suffices


def test_rollback_target_is_the_newest_verified_before_the_alarm():
    from recovery.guards.rollback import RollbackCandidate as C
    from recovery.guards.rollback import choose_rollback_target

    found = [C(100, True, "a"), C(200, True, "b"), C(300, False, "c"), C(350, True, "d"), C(400, True, "e")]
    assert choose_rollback_target(found, alarm_step=380).path == "d"
    assert choose_rollback_target(found, alarm_step=400).path == "d"  # not the save of the alarm step
    assert choose_rollback_target(found, alarm_step=380, min_age_steps=100).path == "b"
    assert choose_rollback_target(found, alarm_step=380, min_age_steps=100, keep_every=100).path == "b"
    assert choose_rollback_target(found, alarm_step=380, min_age_steps=50, keep_every=100,
                                  prefer_permanent=True).path == "b"  # 200: permanent tier, past the age
    assert choose_rollback_target(found, alarm_step=380, min_age_steps=50, keep_every=100,
                                  prefer_permanent=False).path == "b"
    assert choose_rollback_target(found, alarm_step=380, min_age_steps=10, keep_every=0).path == "d"
    assert choose_rollback_target(found, alarm_step=90) is None
