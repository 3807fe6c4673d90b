"""train.py end to end, as a user runs it: real text, real processes, real files."""

import resource
import sys

import pytest
import yaml

from helpers.launch import ROOT, run, run_train
from metrics.records import read_metrics
from tools.runs import debug_overrides

pytestmark = pytest.mark.distributed  # every test starts train.py


def test_debug_experiment_learns_real_text(tmp_path):
    """The README's main CPU command, with the data built on first use (prepare_if_missing)."""
    run_dir = tmp_path / "debug"
    data_dir = tmp_path / "data" / "pydoc-byte"
    proc = run_train(["+experiment=debug", f"output_root={tmp_path}", "run_name=debug",
                      f"data.path={data_dir}", "logging.log_interval=50"])
    assert (data_dir / "meta.json").exists()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 301))  # one row per step
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-10:]) / 10
    assert last <= 0.7 * first, f"loss fell from {first:.3f} to {last:.3f}: less than 30%"
    for key in ("lr", "grad_norm", "tokens_per_s", "step_s", "memory_gib", "tokens"):
        assert key in rows[-1]
    # The guards (recovery/guards) are on by default: a healthy run raises no alarm.
    assert read_metrics(run_dir, "alarm") == [] and not (run_dir / "alarms").exists()
    log = proc.stderr
    assert "world 1 = dp_replicate 1 x dp_shard 1 x tp 1" in log and "resume: fresh start" in log
    assert "step 300/300 | loss" in log and "eta" in log


def test_run_dir_is_stable_and_holds_resolved_config(pydoc_data, tmp_path):
    run_dir = tmp_path / "stable"
    overrides = debug_overrides(run_dir, pydoc_data, steps=2)
    run_train(overrides)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert "${" not in (run_dir / "config.yaml").read_text()  # interpolations resolved
    assert saved["run_dir"] == str(run_dir) and saved["checkpoint"]["dir"] == f"{run_dir}/checkpoints"
    assert yaml.safe_load((run_dir / "overrides.yaml").read_text()) == overrides
    assert not (run_dir / ".hydra").exists()  # Hydra's per-process copies are off
    assert len(read_metrics(run_dir)) == 2


def test_metrics_backends_offline_and_resume_their_run_id(pydoc_data, tmp_path):
    run_dir = tmp_path / "backends"
    overrides = debug_overrides(run_dir, pydoc_data, steps=2, extra={
        "logging.wandb.mode": "offline", "logging.tensorboard": "true"})
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_SILENT": "true"}
    run_train(overrides, extra_env=env)
    run_id = (run_dir / "wandb_run_id").read_text()
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    run_train(overrides, extra_env=env)  # a restart keeps logging into the same wandb run
    assert (run_dir / "wandb_run_id").read_text() == run_id


def test_wandb_online_without_network_or_key_does_not_stop_training(pydoc_data, tmp_path):
    run_dir = tmp_path / "nokey"
    overrides = debug_overrides(run_dir, pydoc_data, steps=2, extra={"logging.wandb.mode": "online"})
    env = {"WANDB_MODE": "", "WANDB_API_KEY": "", "WANDB_INIT_TIMEOUT": "5", "HOME": str(tmp_path)}
    proc = run_train(overrides, extra_env=env)
    assert len(read_metrics(run_dir)) == 2
    assert "wandb" in proc.stderr


def test_dry_run_70b_reports_size_without_allocating():
    cmd = [sys.executable, str(ROOT / "train.py"), "+experiment=70b", "dry_run=true"]
    proc = run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "70,553,706,496 parameters (70.55 B)" in proc.stdout
    assert "tp: 8" in proc.stdout  # the composed config is printed
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert peak_gib < 4, f"a child used {peak_gib:.1f} GiB: the dry run must not allocate the model (282 GB in fp32)"


def test_missing_data_says_how_to_prepare_it(tmp_path):
    run_dir = tmp_path / "nodata"
    proc = run_train(debug_overrides(run_dir, tmp_path / "missing", steps=2), check=False)
    assert proc.returncode != 0
    assert f"no prepared dataset at data.path={tmp_path / 'missing'}" in proc.stderr
    assert "python scripts/prepare_data.py --out" in proc.stderr


def test_bad_config_stops_before_any_work(pydoc_data, tmp_path):
    run_dir = tmp_path / "bad"
    overrides = debug_overrides(run_dir, pydoc_data, steps=5, extra={"optim.warmup_steps": 50})
    proc = run_train(overrides, check=False)
    assert proc.returncode != 0
    assert "optim.warmup_steps=50 is longer than the run (training.steps=5)" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_impossible_batch_split_names_the_numbers(pydoc_data, tmp_path):
    run_dir = tmp_path / "split"
    overrides = debug_overrides(run_dir, pydoc_data, steps=2, extra={"training.micro_batch_size": 3})
    proc = run_train(overrides, check=False)
    assert proc.returncode != 0
    assert "training.global_batch_size=8 is not divisible by dp_size (1) x training.micro_batch_size (3)" in proc.stderr
