"""Convert a committed checkpoint between storage formats, or a Hugging Face Llama folder into a checkpoint
(offline, one CPU process).

  python scripts/convert_checkpoint.py outputs/debug/checkpoints/step_00000300 /tmp/step_300-dcp --to dcp
  python scripts/convert_checkpoint.py /models/Llama-3.2-1B /ckpt/llama32-1b/step_00000000 --to raw

A checkpoint, --to dcp: the raw-bytes data files (checkpoint.format=raw, the default) become stock
DCP files that torch.distributed.checkpoint reads without this project, e.g.

  python -m torch.distributed.checkpoint.format_utils dcp_to_torch /tmp/step_300-dcp full.pt

The layout (which rank saved which shard) is kept, and the result is a committed checkpoint
with its own manifest: train.py resumes from it (checkpoint.resume=PATH), scripts/export.py
exports it, model.init_from imports it. One tensor chunk is in memory at a time.

A Hugging Face folder (config.json + safetensors), --to raw or dcp: a committed step-0 checkpoint of
its weights only, bit for bit (checkpoint/interop/from_hf.py), streamed one tensor at a time and
layout-free, with a copy of the folder's tokenizer.json and tokenizer_config.json (scripts/generate.py DST
then needs no flag, and gives what it gives on the folder); start a run from it with model.init_from=DST
(model=hf takes the shape from it too). A checkpoint converted --to dcp keeps such files too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint.interop.convert import convert_to_dcp
from checkpoint.interop.from_hf import convert_hf_folder
from checkpoint.interop.weight_source import SourceError
from checkpoint.storage import location


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=location,
                   help="a committed step_N directory (a folder or s3://...), or a Hugging Face Llama folder")
    p.add_argument("dst", type=Path, help="the directory to create")
    p.add_argument("--to", choices=["raw", "dcp"], default="dcp",
                   help="the target format: raw (this project's fast format) or dcp (stock DCP)")
    p.add_argument("--no-verify", action="store_true", help="skip checking the source checkpoint's checksums first")
    a = p.parse_args(argv)
    try:
        if not (a.src / "manifest.json").is_file() and (a.src / "config.json").is_file():
            info = convert_hf_folder(a.src, a.dst, a.to)
            kept = (f"its {' and '.join(info['tokenizer'])} kept (scripts/generate.py {a.dst} needs no --data)"
                    if info["tokenizer"] else f"no tokenizer.json in {a.src}: scripts/generate.py {a.dst} needs --data "
                    "DIR, a dataset prepared with the model's tokenizer")
            print(f"wrote {a.dst}: step 0, {info['tensors']} tensors of {info['model'].name} "
                  f"({info['bytes'] / 2**20:.1f} MiB, {a.to}), {kept}; start from it with model.init_from={a.dst}")
            return 0
        if a.to != "dcp":
            raise ValueError(f"{a.src} is a checkpoint: --to raw converts Hugging Face folders; a checkpoint "
                             "converts --to dcp")
        info = convert_to_dcp(a.src, a.dst, verify=not a.no_verify)
    except (SourceError, ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {a.dst}: step {info['step']}, {info['chunks']} tensor chunks re-encoded in {info['files']} "
          f"rank file(s), {info['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
