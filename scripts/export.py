"""Export a checkpoint's weights (offline, one CPU process, one tensor in memory at a time).

  python scripts/export.py outputs/debug/checkpoints/step_00000300 outputs/debug-hf --format hf
  python scripts/export.py CKPT out/model.safetensors --dtype bf16
  python scripts/export.py CKPT out/model.safetensors --weights ema --torch-save out/model.pt

--format hf writes a folder that transformers' LlamaForCausalLM.from_pretrained loads with no
code from this project: config.json, generation_config.json, safetensors shards of at most
--max-shard-size (5GB = 5*10^9 bytes by default; model.safetensors.index.json when there are
several), Hugging Face tensor names with q/k rows in its rotary order (docs/interop.md), and
the tokenizer files of the data the run trained on (its data.path, or --tokenizer; a checkpoint
converted from a Hugging Face folder gives the folder's back).
--format safetensors (the default) writes one file with this project's names; its metadata
records the step, config hash, source checkpoint and model config. Tied weights are written
under both names there (safetensors forbids shared storage); the hf folder holds them once.
Works for a checkpoint written at any layout and in either storage format (raw or dcp).
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

from checkpoint.interop.export import DTYPES, export_hf, export_safetensors
from checkpoint.interop.safetensors_io import parse_size
from checkpoint.storage import location


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=location, help="a committed step_N directory (a folder or s3://...)")
    p.add_argument("out", type=Path, help="the .safetensors file (--format safetensors) or folder (--format hf)")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--weights", choices=["model", "ema"], default="model", help="training weights or their EMA")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest shard file (5GB, 500MB, 2GiB, bytes)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="hf: the prepared dataset folder (or tokenizer.json) whose tokenizer to include "
                        "(default: the tokenizer a checkpoint converted from a Hugging Face folder keeps, else "
                        "the checkpoint's data.path)")
    p.add_argument("--torch-save", type=Path, default=None,
                   help="safetensors: also write a torch.save file here (holds the whole model in memory)")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    a = p.parse_args()
    if a.format == "hf":
        info = export_hf(a.checkpoint, a.out, a.dtype, a.weights, parse_size(a.max_shard_size),
                         verify=not a.no_verify, tokenizer=a.tokenizer)
        print(f"wrote {a.out}: {info['tensors']} tensors in {info['shards']} shard(s), "
              f"{info['bytes'] / 2**20:.1f} MiB {a.dtype} ({a.weights} weights of step {info['step']}); "
              f"tokenizer: {info['tokenizer']}")
    else:
        info = export_safetensors(a.checkpoint, a.out, a.dtype, a.weights, a.torch_save, verify=not a.no_verify)
        print(f"wrote {a.out}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB {a.dtype} "
              f"({a.weights} weights of step {info['step']})")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
