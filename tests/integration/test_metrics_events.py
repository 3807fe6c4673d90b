"""MetricsLogger: MFU in the step line and metrics.jsonl, and events (checkpoint saves, resumes,
alarms, evaluations) in TensorBoard (read back with tensorboard's own reader) and wandb (a
recording stand-in with wandb's rule that a row older than the current step is dropped; the
real wandb is exercised offline by tests/integration/test_train_run.py)."""

from __future__ import annotations

import logging

import pytest

import metrics.logger as logger_module
from metrics.config import LoggingConfig, WandbConfig
from metrics.logger import MetricsLogger
from metrics.records import read_metrics
from metrics.throughput import Throughput
from model.config import ModelConfig
from model.counting import flops_per_token


class RecordingWandb:
    """The calls MetricsLogger makes on a wandb run, with wandb's step rule."""

    def __init__(self):
        self.step, self.rows, self.dropped, self.axes, self.summary = 0, [], [], {}, {}

    def log(self, row, step):
        if step < self.step:
            self.dropped.append((step, row))  # wandb warns and drops it
            return
        self.step = step
        self.rows.append((step, dict(row)))

    def define_metric(self, name, step_metric=None):
        self.axes[name] = step_metric

    def finish(self):
        pass


def test_throughput_is_model_flops_over_peak():
    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)
    got = Throughput(cfg, 128, devices=4, peak_tflops=2.0)(tokens_per_s=1e6)
    tflops = flops_per_token(cfg, 128) * 1e6 / 4 / 1e12
    assert got == {"tflops_per_device": tflops, "mfu": tflops / 2.0}
    with pytest.raises(ValueError, match=r"logging.peak_tflops \(0\) > 0"):
        Throughput(cfg, 128, devices=1, peak_tflops=0)


def test_events_reach_tensorboard_and_wandb(tmp_path, monkeypatch, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wandb = RecordingWandb()
    monkeypatch.setattr(logger_module, "_start_wandb", lambda run_dir, w, name, config: wandb)
    lg = LoggingConfig(tensorboard=True, wandb=WandbConfig(mode="offline"))
    m = MetricsLogger(tmp_path, lg, is_main=True, total_steps=6)
    ckpt = dict(kind="checkpoint", mode="async", blocking_s=0.25, background_s=1.5, bytes=1000, committed=True)
    with caplog.at_level(logging.INFO, logger="trainer"):
        m.log_event(2, kind="resume", checkpoint_id="step_00000002", load_s=0.5, skipped=[])
        for step in range(3, 7):
            m.log_step(step, {"loss": 3.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 * step,
                              "step_s": 0.1, "memory_gib": 1.0, "tflops_per_device": 0.5, "mfu": 0.001}, 0.1)
            if step == 4:
                m.log_event(4, kind="alarm", check="loss_spike", action="skip_step", detail="loss 9 > 3")
                m.log_eval(4, 2.5, 4096, 0.2)
            if step == 5:
                m.log_event(4, **ckpt)  # an async save of step 4, reported a step later
    m.close()
    assert "| 0.5 TFLOP/s/device | MFU 0.1% |" in caplog.text
    assert "eval after step 4 | val_loss 2.5000 | 4096 tokens" in caplog.text
    assert [r["mfu"] for r in read_metrics(tmp_path)] == [0.001] * 4
    assert read_metrics(tmp_path, "eval") == [{"step": 4, "kind": "eval", "val_loss": 2.5, "val_tokens": 4096,
                                                "eval_s": 0.2}]

    tb = EventAccumulator(str(tmp_path / "tensorboard"))
    tb.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in tb.Scalars(tag)]  # noqa: E731
    assert scalars("checkpoint/blocking_s") == [(4, 0.25)] and scalars("checkpoint/background_s") == [(4, 1.5)]
    assert scalars("events/resume") == [(2, 1.0)] and scalars("resume/load_s") == [(2, 0.5)]
    assert scalars("events/alarm") == [(4, 1.0)]
    assert scalars("val_loss") == [(4, 2.5)] and scalars("mfu") == [(s, pytest.approx(0.001)) for s in range(3, 7)]

    assert wandb.dropped == []  # nothing logged at a step wandb had already passed
    logged = {k: (step, v) for step, row in wandb.rows for k, v in row.items()}
    assert logged["checkpoint/blocking_s"] == (5, 0.25) and logged["checkpoint/step"] == (5, 4)
    assert wandb.axes["checkpoint/*"] == "checkpoint/step" and wandb.axes["events/checkpoint"] == "checkpoint/step"
    assert logged["val_loss"] == (4, 2.5) and logged["mfu"] == (6, 0.001) and logged["events/alarm"] == (4, 1)
    assert wandb.summary["events/resume_count"] == 1 and wandb.summary["events/alarm_count"] == 1
    assert wandb.summary["last_checkpoint"]["background_s"] == 1.5 and wandb.summary["last_checkpoint"]["step"] == 4


@pytest.mark.distributed  # starts train.py
def test_a_real_run_sends_validation_mfu_and_saves_to_tensorboard_and_offline_wandb(pydoc_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rehearsal.runs import debug_overrides
    from support.launch import run_train

    run_dir = tmp_path / "backends"
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=4, extra={
        "checkpoint.interval": 2, "eval.interval": 2, "logging.tensorboard": "true", "logging.wandb.mode": "offline"}),
        extra_env={"WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_SILENT": "true"})
    assert "wandb logging" not in proc.stderr and "wandb disabled" not in proc.stderr
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    steps = lambda tag: [e.step for e in tb.Scalars(tag)]  # noqa: E731
    evals = {r["step"]: r["val_loss"] for r in read_metrics(run_dir, "eval")}
    assert [(e.step, e.value) for e in tb.Scalars("val_loss")] == [(s, pytest.approx(v)) for s, v in evals.items()]
    assert sorted(evals) == [2, 4] and steps("checkpoint/blocking_s") == [2, 4] and steps("mfu") == [1, 2, 3, 4]
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_a_failing_wandb_never_stops_training(tmp_path, monkeypatch, caplog):
    """wandb raising (a network error, a full disk) on a step row or an event: logged, and training goes on."""

    class Broken(RecordingWandb):
        def log(self, row, step=None):
            raise ConnectionError("wandb is down")

    monkeypatch.setattr(logger_module, "_start_wandb", lambda run_dir, w, name, config: Broken())
    m = MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="offline")), is_main=True, total_steps=2)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        m.log_step(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "step_s": 0.1,
                       "memory_gib": 0.1}, step_seconds_avg=0.1)
        m.log_event(1, kind="resume", checkpoint_id="step_00000001", load_s=0.5, skipped=[])
    m.close()
    assert caplog.text.count("wandb is down") == 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # metrics.jsonl has the row all the same
