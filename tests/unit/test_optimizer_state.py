"""training.optimizer.init_state: a load's optimizer state made directly instead of by DCP's zero-lr step
(torch.distributed.checkpoint.state_dict._init_optim_state). It must leave the same state, tensor for
tensor, and the same training afterwards; a load must then run no optimizer step; any other optimizer keeps
DCP's way. In this process: FSDP2 on a group of one (DTensor shards, as at several ranks) and unwrapped."""

from __future__ import annotations

import contextlib

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.tensor import DTensor

from checkpoint.state.training_state import TrainingState
from model.config import ModelConfig
from model.llama import build_model
from parallel.config import ParallelConfig
from parallel.dims import resolve_parallel_dims
from parallel.init import init_distributed, shutdown_distributed
from parallel.parallelize import materialize_parallel_model, parallelize_model
from training.config import OptimConfig
from training.optimizer import build_optimizer, init_state
from training.schedule import build_scheduler
from training.step import Precision, train_step

CPU = torch.device("cpu")


@contextlib.contextmanager
def maybe_group_of_one(fsdp: bool):
    if fsdp:
        init_distributed("cpu", 60.0, group_of_one=True)
    try:
        yield
    finally:
        if fsdp:
            shutdown_distributed()


def _setup(fsdp: bool, implementation: str):
    model = build_model(ModelConfig(), materialize=False)
    pcfg = OmegaConf.structured(ParallelConfig(dp_shard=1, device="cpu", force_fsdp=fsdp))
    parallel = parallelize_model(model, resolve_parallel_dims(1, 1, 1, 1, fsdp), pcfg, CPU, seq_len=32)
    materialize_parallel_model(model, parallel, CPU, seed=0)
    ocfg = OmegaConf.structured(OptimConfig(warmup_steps=1, implementation=implementation))
    optimizer = build_optimizer(model, ocfg)
    return model, parallel, optimizer, build_scheduler(optimizer, ocfg, 8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.reshape(-1)


def _losses(model, parallel, optimizer, scheduler, steps=3) -> list:
    out = []
    for step in range(steps):
        rows = torch.randint(0, 320, (4, 33), generator=torch.Generator().manual_seed(step))
        micro = [(rows[:2, :-1], rows[:2, 1:]), (rows[2:, :-1], rows[2:, 1:])]
        out.append(train_step(model, optimizer, scheduler, Precision("fp32", CPU), micro, 1.0, CPU,
                              before_micro_batch=lambda last: parallel.before_micro_batch(model, last)).loss)
    return out


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp-one-rank", "unwrapped"])
def test_the_direct_state_is_dcps_tensor_for_tensor_and_trains_the_same(fsdp, implementation):
    with maybe_group_of_one(fsdp):
        runs = []
        for way in ("dcp", "direct"):
            model, parallel, optimizer, scheduler = _setup(fsdp, implementation)
            before = [_bits(p).clone() for p in model.parameters()]
            if way == "dcp":
                _init_optim_state(optimizer)
            else:
                assert init_state(optimizer)
            assert [torch.equal(b, _bits(p)) for b, p in zip(before, model.parameters())] == [True] * len(before)
            assert all(p.grad is None for p in model.parameters())
            state = [(k, type(v), v.dtype, v.device, tuple(v.shape), v.stride(),
                      getattr(v, "placements", None), _bits(v).tolist())
                     for p in model.parameters() for k, v in sorted(optimizer.state[p].items())]
            runs.append((state, _losses(model, parallel, optimizer, scheduler)))
        (dcp_state, dcp_losses), (direct_state, direct_losses) = runs
        assert len(dcp_state) == 3 * len(list(model.parameters()))  # step, exp_avg, exp_avg_sq each
        assert direct_state == dcp_state
        assert direct_losses == dcp_losses  # bitwise


def test_a_load_template_runs_no_optimizer_step_and_other_optimizers_keep_dcps_way():
    with maybe_group_of_one(True):
        model, _, optimizer, scheduler = _setup(True, "foreach")
        steps = []
        optimizer.register_step_pre_hook(lambda *a: steps.append(1))
        sd = TrainingState(model, optimizer, scheduler).state_dict()  # what a load reads into
        assert steps == []  # no zero-lr step: its sharding propagation was most of a resume's CPU
        assert len(sd["optim"]["state"]) == len(list(model.parameters()))
        assert {float(s["step"]) for s in sd["optim"]["state"].values()} == {1.0}  # as DCP's step leaves it

        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        assert not init_state(sgd)
        sgd.register_step_pre_hook(lambda *a: steps.append(1))
        sd = TrainingState(model, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)).state_dict()
        assert steps == [1]  # DCP's way
        assert len(sd["optim"]["state"]) == len(list(model.parameters()))


@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True, "amsgrad": True}], ids=["fused", "amsgrad"])
def test_fused_and_amsgrad_adamw_get_dcps_state_too(flags):
    """optim.implementation=fused (on CPU here: torch's fused AdamW runs there too) keeps ``step`` where the
    fused kernel wants it; amsgrad (not a config choice) adds its running maximum."""
    states = []
    for way in (_init_optim_state, init_state):
        model = torch.nn.Linear(4, 3)
        torch.manual_seed(0)
        model.reset_parameters()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
        way(optimizer)
        states.append([(k, v.dtype, v.device, tuple(v.shape), v.tolist())
                       for p in model.parameters() for k, v in sorted(optimizer.state[p].items())])
    assert states[0] == states[1]
    assert len(states[0]) == 2 * (4 if flags.get("amsgrad") else 3)
