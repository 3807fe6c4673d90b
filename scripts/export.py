"""Consolidate a checkpoint's weights into one safetensors file (offline, one CPU process).

  python scripts/export.py outputs/debug/checkpoints/step_00000300 out/model.safetensors --dtype bf16
  python scripts/export.py CKPT out/model.safetensors --weights ema --torch-save out/model.pt

Works for a checkpoint written at any layout (FSDP/TP shards are reassembled from DCP's
metadata). The safetensors metadata records the step, config hash and source checkpoint.
Tied weights are written once per name (safetensors forbids shared storage).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from checkpoint.export import load_tensors
from checkpoint.manifest import read_manifest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: Path, out: Path, dtype: str = "fp32", weights: str = "model",
           torch_save: Path | None = None, verify: bool = True) -> dict:
    from safetensors.torch import save_file

    manifest = read_manifest(checkpoint)
    tensors = load_tensors(checkpoint, prefix=f"{weights}.", verify=verify)
    tensors = {k: v.to(DTYPES[dtype]).contiguous().clone() for k, v in sorted(tensors.items())}
    meta = {"step": str(manifest.step), "config_hash": manifest.config_hash, "weights": weights,
            "dtype": dtype, "source": str(Path(checkpoint).resolve()),
            "model": json.dumps(manifest.config.get("model", {}))}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    if torch_save is not None:
        torch_save.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, torch_save)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), **meta}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a committed step_N directory")
    p.add_argument("out", type=Path, help="the .safetensors file to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--weights", choices=["model", "ema"], default="model", help="training weights or their EMA")
    p.add_argument("--torch-save", type=Path, default=None, help="also write a torch.save file here")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    a = p.parse_args()
    info = export(a.checkpoint, a.out, a.dtype, a.weights, a.torch_save, verify=not a.no_verify)
    print(f"wrote {a.out}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB {a.dtype} "
          f"({a.weights} weights of step {info['step']})")


if __name__ == "__main__":
    main()
