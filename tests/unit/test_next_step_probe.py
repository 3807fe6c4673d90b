"""An async save's probe is the next step's first micro-batch loss (recovery/probe.py NEXT_MICRO_BATCH):
the save runs no probe forward, its commit waits for that loss, and post-load verification recomputes it,
so a load whose weights do not reproduce it is still refused before the first optimizer step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from checkpoint.durable.manifest import VerificationFailed, read_manifest
from checkpoint.state.training_state import TrainingState
from data.batching import make_batch_plan
from data.setup import build_data_pipeline
from model.llama import build_model
from parallel.dims import ParallelDims
from recovery.probe import NEXT_MICRO_BATCH, make_probe
from recovery.verify import ResumeVerifier
from support.config import compose_debug
from trainer.config import typed
from trainer.run import checkpoint_manager
from training.optimizer import build_optimizer
from training.schedule import build_scheduler
from training.step import Precision, train_step

CPU = torch.device("cpu")


def _run(cfg, world):
    """A world-1 run's pieces in this process, as trainer/run.py builds them."""
    t = cfg.training
    plan = make_batch_plan(t.global_batch_size, t.micro_batch_size, 1)
    model = build_model(OmegaConf.to_object(cfg.model), seed=0)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)
    data = build_data_pipeline(cfg.data, t.seq_len, cfg.seed, plan, 0, world, model_vocab_size=cfg.model.vocab_size)
    state = TrainingState(model, optimizer, scheduler, data=data, optim_config=cfg.optim)
    probe = make_probe(model, data, CPU)
    probe.weights_version = lambda: state.weights_version
    ckpt = checkpoint_manager(typed(cfg)[0], state, 0, 1, ParallelDims(1, 1, 1, 1).layout, CPU, probe=probe)
    return state, probe, ckpt


def _step(state, ckpt):
    """One training step of the loop, handing its first micro-batch's loss to the manager."""
    result = train_step(state.model, state.optimizer, state.scheduler, Precision("fp32", CPU),
                        state.data.next_micro_batches(state.step), 1.0, CPU,
                        global_tokens=None)
    state.record_step(result.target_tokens, state.data.plan.global_batch_size)
    ckpt.took_step(result.first_loss)
    return result


def test_an_async_save_runs_no_probe_and_a_wrong_load_is_refused_before_the_first_update(tmp_path, pydoc_data):
    cfg = compose_debug(f"output_root={tmp_path}", "run_name=next-step-probe", f"data.path={pydoc_data}",
                        "checkpoint.interval=2", "checkpoint.async_mode=async", "training.steps=4",
                        "training.global_batch_size=4", "training.micro_batch_size=2", "training.seq_len=32")
    world = SimpleNamespace(local_rank=0, device=CPU)  # the data is prepared: nothing is built
    state, probe, ckpt = _run(cfg, world)
    forwards = []
    state.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        _step(state, ckpt)
        _step(state, ckpt)
        forwards.clear()
        ckpt.after_step(2, 5.0, probe_from_next_step=True)
        assert forwards == []  # the save's blocking part ran no forward
        next_batch = probe.next_micro_batch()
        third = _step(state, ckpt)  # its first micro-batch's loss completes step 2's manifest
        _step(state, ckpt)
        ckpt.after_step(4, 5.0, probe_from_next_step=True)
        ckpt.wait()  # before the next step (a preemption's wait): the probe is computed now, on the same weights
        fifth = _step(state, ckpt)
    finally:
        ckpt.close()
    path = ckpt.root / "step_00000002"
    manifest = read_manifest(path)
    tokens = state.data.dataset.target_count(next_batch)
    assert manifest.probe_method == NEXT_MICRO_BATCH
    assert manifest.probe_samples == [next_batch.start, next_batch.count]
    assert manifest.probe_loss == float(third.first_loss) / tokens
    settled = read_manifest(ckpt.root / "step_00000004")
    assert settled.probe_method == NEXT_MICRO_BATCH
    assert settled.probe_loss == float(fifth.first_loss) / state.data.dataset.target_count(
        type(next_batch)(*settled.probe_samples))  # the value the step after computes

    def load(path):
        state, probe, ckpt = _run(cfg, world)
        try:
            verifier = ResumeVerifier(cfg.recovery, cfg.optim, cfg.training.steps, ckpt, state, probe,
                                      dict(ckpt.layout), 1)
            ckpt.load(path, verifier)
            return verifier.report
        finally:
            ckpt.close()

    assert load(path)["problems"] == []  # recomputed bitwise from the loaded weights
    raw = json.loads((path / "manifest.json").read_text())
    raw["probe_loss"] *= 1 + 1e-6  # the bytes pass their checksums, the weights do not reproduce the loss
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(VerificationFailed, match="probe loss"):
        load(path)
