"""The optimizer step: global-token loss normalisation, accumulation invariance, LR schedule."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from model.config import ModelConfig
from model.llama import build_model
from training.config import OptimConfig
from training.optimizer import build_optimizer
from training.schedule import build_scheduler, lr_at
from training.step import IGNORE_INDEX, Precision, token_loss_sum, train_step

CPU = torch.device("cpu")


def _setup(seed=0, steps=10):
    model = build_model(ModelConfig(), seed=seed)
    cfg = OmegaConf.structured(OptimConfig(warmup_steps=2))
    opt = build_optimizer(model, cfg)
    return model, opt, build_scheduler(opt, cfg, steps)


def _batch(n=8, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 320, (n, seq + 1), generator=g)
    inputs, targets = rows[:, :-1], rows[:, 1:].clone()
    return inputs, targets


def _split(inputs, targets, micro):
    return [(inputs[i:i + micro], targets[i:i + micro]) for i in range(0, len(inputs), micro)]


def test_loss_is_global_token_mean_not_mean_of_micro_means():
    inputs, targets = _batch()
    targets[:4, 8:] = IGNORE_INDEX  # first micro-batch has half the targets of the second
    model, opt, sched = _setup()
    with torch.no_grad():
        sums = [token_loss_sum(model(i), t).item() for i, t in _split(inputs, targets, 4)]
    counts = [(t != IGNORE_INDEX).sum().item() for _, t in _split(inputs, targets, 4)]
    global_mean = sum(sums) / sum(counts)
    mean_of_means = sum(s / c for s, c in zip(sums, counts)) / 2
    assert abs(global_mean - mean_of_means) > 1e-4  # the two definitions really differ here
    result = train_step(model, opt, sched, Precision("fp32", CPU), _split(inputs, targets, 4), 0.0, CPU)
    assert result.loss == pytest.approx(global_mean, rel=1e-6)
    assert result.target_tokens == sum(counts)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulation_split_gives_the_same_update(micro):
    inputs, targets = _batch()
    targets[:3, 5:] = IGNORE_INDEX
    ref_model, ref_opt, ref_sched = _setup()
    train_step(ref_model, ref_opt, ref_sched, Precision("fp32", CPU), [(inputs, targets)], 1.0, CPU)
    model, opt, sched = _setup()
    train_step(model, opt, sched, Precision("fp32", CPU), _split(inputs, targets, micro), 1.0, CPU)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_clipping_bounds_the_update_and_reports_the_unclipped_norm():
    inputs, targets = _batch()
    model, opt, sched = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, opt, sched, Precision("fp32", CPU), [(inputs, targets)], 1e-3, CPU)
    assert result.grad_norm > 1e-3  # reported before clipping
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_modes_train(mode):
    inputs, targets = _batch()
    model, opt, sched = _setup()
    precision = Precision(mode, CPU)
    assert (precision.scaler is not None) == (mode == "fp16")
    losses = [train_step(model, opt, sched, precision, [(inputs, targets)], 1.0, CPU).loss for _ in range(5)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_lr_schedule_formula():
    kw = dict(lr_max=1e-3, lr_min=1e-4, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak: step 0 already trains
    assert lr_at(9, **kw) == pytest.approx(1e-3)  # warmup ends at the peak
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way: the mean
    assert lr_at(110, **kw) == pytest.approx(1e-4)
    lrs = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay
    assert lr_at(50, **{**kw, "schedule": "constant"}) == 1e-3


def test_scheduler_applies_the_formula_each_step():
    model, opt, sched = _setup(steps=10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [lr_at(s, lr_max=3e-4, lr_min=3e-5, warmup_steps=2, total_steps=10) for s in range(10)]
    assert seen == pytest.approx(expected)


def test_weight_decay_skips_norms():
    model, opt, _ = _setup()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_vetoed_update_leaves_weights_and_optimizer_untouched(mode):
    inputs, targets = _batch()
    model, opt, sched = _setup()
    precision = Precision(mode, CPU)
    train_step(model, opt, sched, precision, [(inputs, targets)], 1.0, CPU)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    seen = []
    result = train_step(model, opt, sched, precision, [(inputs, targets)], 1.0, CPU,
                        allow_update=lambda stats: seen.append(stats.loss) or False)
    assert result.skipped and seen == [result.loss]
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert sched.last_epoch == 2  # the step still consumed its LR step (and its data)
