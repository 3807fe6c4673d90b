"""checkpoint.format=dcp and scripts/convert_checkpoint.py, proven with stock torch: both give
directories that ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` reads (no code
from this project) into the same tensors and values as the raw-format checkpoint of the same run,
and a dcp-format run killed mid-way resumes bit for bit (2 ranks, dp_shard=2, defaults on).
"""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.writer import RAW
from checkpoint.interop.export import load_tensors
from checkpoint.interop.init_from import load_initial_weights
from checkpoint.interop.weight_source import open_source
from metrics.records import step_losses
from model.config import ModelConfig
from model.llama import build_model
from rehearsal.chains import faults_override
from rehearsal.runs import debug_overrides
from support.launch import ROOT, run, run_train

pytestmark = pytest.mark.distributed  # train.py under torchrun

STEPS = 6
EXTRA = {"parallel.dp_shard": 2, "checkpoint.interval": 3, "checkpoint.keep_last": 3, "training.ema_decay": 0.9}


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory, pydoc_data):
    run_dir = tmp_path_factory.mktemp("formats") / "raw"
    run_train(debug_overrides(run_dir, pydoc_data, steps=STEPS, extra=EXTRA), nproc=2)
    return run_dir


def stock_load(path, tmp_path) -> dict:
    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def assert_same_state(stock: dict, raw_ckpt) -> None:
    """Every model, optimizer and EMA tensor of the raw checkpoint (consolidated) equals the stock read."""
    for prefix in ("model", "ema"):
        raw = load_tensors(raw_ckpt, prefix=f"{prefix}.")
        assert stock[prefix].keys() == raw.keys()
        for name, t in raw.items():
            assert torch.equal(stock[prefix][name], t), f"{prefix}.{name}"
    raw_optim = load_tensors(raw_ckpt, prefix="optim.")
    flat = {}

    def walk(node, key):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, torch.Tensor):
            flat[key] = node

    walk(stock["optim"], "")
    assert raw_optim and all(torch.equal(flat[k], v) for k, v in raw_optim.items())
    progress = pickle.loads(stock["progress"].getvalue() if hasattr(stock["progress"], "getvalue")
                            else stock["progress"])
    assert progress["step"] == STEPS


def test_dcp_format_run_is_stock_readable_and_resumes_bitwise(raw_run, pydoc_data, tmp_path):
    run_dir = tmp_path / "dcp"
    extra = {**EXTRA, "checkpoint.format": "dcp"}
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": 5, "rank": 0}])
    killed = run_train(debug_overrides(run_dir, pydoc_data, steps=STEPS, extra=extra) + [kill], nproc=2,
                       check=False)
    assert killed.returncode != 0
    ckpt3 = run_dir / "checkpoints" / "step_00000003"
    infos = RawFileReader(ckpt3).read_metadata().storage_data.values()
    assert infos and not any(RAW in (i.transform_descriptors or ()) for i in infos)  # stock DCP items only
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=STEPS, extra=extra), nproc=2)
    assert "resume: from" in proc.stderr and "step_00000003" in proc.stderr
    ref, got = step_losses(raw_run), step_losses(run_dir)
    assert all(got[s] == ref[s] for s in range(1, STEPS + 1)), (got, ref)
    assert_same_state(stock_load(run_dir / "checkpoints" / f"step_{STEPS:08d}", tmp_path),
                      raw_run / "checkpoints" / f"step_{STEPS:08d}")
    # the project's own offline reader (scripts/export.py) reads the stock files too
    got, want = (load_tensors(r / "checkpoints" / f"step_{STEPS:08d}") for r in (run_dir, raw_run))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_converted_raw_checkpoint_is_stock_readable_and_resumable(raw_run, pydoc_data, tmp_path):
    src = raw_run / "checkpoints" / f"step_{STEPS:08d}"
    with pytest.raises(CheckpointException) as refused:  # the raw format is refused by stock DCP, never misread
        dcp_to_torch_save(src, tmp_path / "refused.pt")
    assert "Unknown extension name='raw-bytes'" in repr(refused.value.failures)
    dst = tmp_path / "converted"
    proc = run([sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), str(src), str(dst), "--to", "dcp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_state(stock_load(dst, tmp_path), src)
    # model.init_from reads it (checksums checked first, then deserialised): the raw checkpoint's weights
    model = build_model(ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "configs/model/debug.yaml"))))
    load_initial_weights(model, open_source(dst), torch.device("cpu"))
    raw = load_tensors(src)
    assert all(torch.equal(p.detach(), raw[n]) for n, p in model.named_parameters())
    # still a committed checkpoint of this project: a run resumes from it (at another layout) and goes on
    run_dir = tmp_path / "again"
    proc = run_train(debug_overrides(run_dir, pydoc_data, steps=STEPS + 2, extra={
        **EXTRA, "parallel.dp_shard": 1, "checkpoint.resume": str(dst)}))
    assert f"resume: from {dst} (step {STEPS}" in proc.stderr
    assert sorted(step_losses(run_dir)) == [STEPS + 1, STEPS + 2]
