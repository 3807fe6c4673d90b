"""Convert a committed checkpoint between storage formats (offline, one CPU process).

  python scripts/convert_checkpoint.py outputs/debug/checkpoints/step_00000300 /tmp/step_300-dcp --to dcp

--to dcp: the raw-bytes data files (checkpoint.format=raw, the default) become stock DCP files
that torch.distributed.checkpoint reads without this project, e.g.

  python -m torch.distributed.checkpoint.format_utils dcp_to_torch /tmp/step_300-dcp full.pt

The layout (which rank saved which shard) is kept, and the result is a committed checkpoint
with its own manifest: train.py resumes from it (checkpoint.resume=PATH), scripts/export.py
exports it, model.init_from imports it. One tensor chunk is in memory at a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from checkpoint.interop.convert import convert_to_dcp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="a committed step_N directory")
    p.add_argument("dst", type=Path, help="the directory to create")
    p.add_argument("--to", choices=["dcp"], default="dcp", help="the target format (stock DCP)")
    p.add_argument("--no-verify", action="store_true", help="skip checking the source's checksums first")
    a = p.parse_args()
    info = convert_to_dcp(a.src, a.dst, verify=not a.no_verify)
    print(f"wrote {a.dst}: step {info['step']}, {info['chunks']} tensor chunks re-encoded in {info['files']} "
          f"rank file(s), {info['bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
