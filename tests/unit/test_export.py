"""scripts/export.py: a DCP checkpoint consolidated into one safetensors file loads into an
unsharded model and gives the same logits (fp32: bitwise; bf16: within bf16 rounding)."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoint.durable.discovery import committed_dir
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.state.training_state import TrainingState
from model.config import ModelConfig
from model.llama import build_model
from support.launch import ROOT, run
from training.ema import EMA

CFG = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_model(CFG, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = EMA(model, 0.5)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    for _ in range(2):
        model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    state = TrainingState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), ema=ema)
    state.step = 2
    root = tmp_path_factory.mktemp("export")
    saver = CheckpointSaver(root, "sync", 0, 1)
    saver.save(state.state_dict(), Manifest("step_00000002", 2, 0, 0, 0.0, "h", {"model": vars(CFG)}, 1, {}, 2,
                                            None, None, None))
    return committed_dir(root, 2), model, ema, tokens[:, :-1]


def export(ckpt, out, *args):
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(ckpt), str(out), *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def unsharded(weights):
    model = build_model(CFG, seed=0)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def test_fp32_export_round_trip_is_exact(checkpoint, tmp_path):
    ckpt, model, _, inputs = checkpoint
    proc = export(ckpt, tmp_path / "m.safetensors", "--torch-save", str(tmp_path / "m.pt"))
    assert "model weights of step 2" in proc.stdout
    weights = load_file(tmp_path / "m.safetensors")
    assert set(weights) == set(model.state_dict())
    with torch.no_grad():
        expected = model.eval()(inputs)
        assert torch.equal(unsharded(weights)(inputs), expected)
        assert torch.equal(unsharded(torch.load(tmp_path / "m.pt"))(inputs), expected)


def test_bf16_and_ema_exports(checkpoint, tmp_path):
    ckpt, model, ema, inputs = checkpoint
    export(ckpt, tmp_path / "bf16.safetensors", "--dtype", "bf16")
    weights = load_file(tmp_path / "bf16.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    with torch.no_grad():
        expected = model.eval()(inputs)
        got = unsharded({k: v.float() for k, v in weights.items()})(inputs)
    assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2)  # bf16 keeps 8 mantissa bits
    assert not torch.equal(got, expected)
    export(ckpt, tmp_path / "ema.safetensors", "--weights", "ema")
    ema_weights = load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(ema_weights[k], ema.shadow[k]) for k in ema.shadow)


def test_export_refuses_a_corrupt_checkpoint(checkpoint, tmp_path):
    import shutil

    ckpt = shutil.copytree(checkpoint[0], tmp_path / "step_00000002")
    data = next(ckpt.glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    proc = run([sys.executable, str(ROOT / "scripts" / "export.py"), str(ckpt), str(tmp_path / "x")], timeout=300)
    assert proc.returncode != 0 and "is corrupt" in proc.stderr and "manifest says" in proc.stderr
