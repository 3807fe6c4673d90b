"""Run by test_export_memory.py: build a large checkpoint, or export one and report its peak memory.

  python tests/support/workers/export_memory.py make ROOT PRESET [KEY=VALUE ...]   # a freshly initialised
                          # configs/model/PRESET.yaml (with model overrides), saved by the project's saver
  python tests/support/workers/export_memory.py export CKPT OUT ARGS   # scripts/export.py's export, then one JSON line:
                                                               # RSS before it, peak RSS (VmHWM), the weights' bytes

  python tests/support/workers/export_memory.py make_hf OUT PRESET [KEY=VALUE ...]   # a Hugging Face folder of that
                          # shape (config.json + one safetensors file), written tensor by tensor
  python tests/support/workers/export_memory.py convert HF DST raw|dcp  # convert_checkpoint.py's conversion, then the
                                                         # same JSON line (and the largest tensor's bytes)

Peak RSS comes from /proc/self/status (VmHWM: the high-water mark of resident memory), read after
the export; the baseline is VmRSS right before it, after every import.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.interop.export import CheckpointTensors, export_hf, model_config_of
from model.config import ModelConfig
from model.counting import count_params
from model.llama import build_model

ROOT = Path(__file__).resolve().parents[3]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def make(root: Path, preset: str, overrides: list) -> None:
    shape = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "model" / f"{preset}.yaml"),
                            OmegaConf.from_dotlist(overrides))
    cfg = ModelConfig(**OmegaConf.to_container(shape))
    t0 = time.perf_counter()
    model = build_model(cfg, seed=0)
    manifest = Manifest("step_00000001", 1, 0, 0, 0.0, "export_memory", {"model": dataclasses.asdict(cfg)}, 1,
                        {"dp_shard": 1, "tp": 1}, 1, None, None, None, components=["model"])
    CheckpointSaver(root, "sync", 0, 1).save({"model": model.state_dict()}, manifest)
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - t0}))


def make_hf(out: Path, preset: str, overrides: list) -> None:
    """Every tensor a constant (writing, not drawing random numbers, is the cost worth paying here)."""
    import torch

    from checkpoint.interop.safetensors_io import SafetensorsFile, TensorSpec
    from model.hf import hf_config, hf_name

    shape = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "model" / f"{preset}.yaml"),
                            OmegaConf.from_dotlist(overrides))
    cfg = ModelConfig(**OmegaConf.to_container(shape))
    params = {n: p for n, p in build_model(cfg, materialize=False).named_parameters()}  # meta; tied: once
    specs = [TensorSpec(hf_name(n, cfg), tuple(p.shape), torch.float32) for n, p in params.items()]
    out.mkdir(parents=True)
    f = SafetensorsFile(out / "model.safetensors", specs, {"format": "pt"})
    for i, (n, p) in enumerate(params.items()):
        f.write(hf_name(n, cfg), torch.full(tuple(p.shape), 0.001 * (i + 1)))
    f.close()
    (out / "config.json").write_text(json.dumps(hf_config(cfg, "float32", 1, 0)))


def convert(hf: Path, dst: Path, fmt: str) -> None:
    from checkpoint.interop.from_hf import convert_hf_folder, folder_model_config

    cfg = folder_model_config(hf)
    fp32_bytes = 4 * count_params(cfg).total
    largest = 4 * max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_hidden_dim, cfg.dim * cfg.dim)
    before = status_kib("VmRSS")
    t0 = time.perf_counter()
    info = convert_hf_folder(hf, dst, fmt)
    print(json.dumps({"rss_before": before * 1024, "peak_rss": status_kib("VmHWM") * 1024,
                      "fp32_weight_bytes": fp32_bytes, "written_bytes": info["bytes"], "largest_tensor": largest,
                      "seconds": time.perf_counter() - t0}))


def export(ckpt: Path, out: Path, dtype: str) -> None:
    cfg = model_config_of(CheckpointTensors(ckpt, verify=False).manifest)
    fp32_bytes = 4 * count_params(cfg).total  # the model's weights in fp32 (a tied tensor once)
    before = status_kib("VmRSS")
    t0 = time.perf_counter()
    info = export_hf(ckpt, out, dtype=dtype)
    print(json.dumps({"rss_before": before * 1024, "peak_rss": status_kib("VmHWM") * 1024,
                      "fp32_weight_bytes": fp32_bytes, "written_bytes": info["bytes"], "shards": info["shards"],
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "make_hf":
        make_hf(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        export(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
