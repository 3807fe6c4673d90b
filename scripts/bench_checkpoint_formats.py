"""checkpoint.format benchmark (not a test): raw vs stock DCP files for one training state, in turns.

  python scripts/bench_checkpoint_formats.py --dir /tmp/fmt-bench            # 1.5 GiB: 134M params + AdamW
  python scripts/bench_checkpoint_formats.py --dir /tmp/fmt-bench --cold     # drop the page cache first (root)

For each format, --reps times and taking turns: a sync save (write, checksum, commit), the size on
disk, a verified load (checkpoint/durable/loader.py, what a resume does) and, as the floor, one plain
sequential read of the same data files. Reads are from the page cache unless --cold (which needs
root and slows everyone else on the machine for a while). Medians are reported, and each load as
a multiple of its own read floor: raw reads bytes straight into the tensors and checksums them on
the way; dcp checks every file's checksum first, then deserialises each tensor (torch.load) and
copies it into place.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from checkpoint.durable.layout import checkpoint_dir
from checkpoint.durable.loader import load_checkpoint
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.state.training_state import TrainingState, local_state_bytes
from model.config import ModelConfig
from model.llama import build_model

GiB = 2**30


def drop_caches() -> None:
    import os

    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_floor(paths, cold: bool) -> float:
    if cold:
        drop_caches()
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/fmt-bench"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each read (root only)")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    cfg = ModelConfig(name="bench", dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64, vocab_size=a.vocab,
                      max_seq_len=128)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for prm in model.parameters():
        prm.grad = torch.randn_like(prm) * 1e-3
    opt.step()
    state = TrainingState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    nbytes = local_state_bytes(state.state_dict())
    print(f"state {nbytes / GiB:.2f} GiB ({sum(x.numel() for x in model.parameters()) / 1e6:.0f} M params + AdamW), "
          f"reads {'cold' if a.cold else 'from the page cache'}, {torch.get_num_threads()} torch threads")
    rows = {f: [] for f in ("raw", "dcp")}
    for rep in range(a.reps):
        for fmt in (("raw", "dcp") if rep % 2 == 0 else ("dcp", "raw")):
            root = a.dir / fmt
            shutil.rmtree(root, ignore_errors=True)
            saver = CheckpointSaver(root, "sync", 0, 1, storage_format=fmt)
            state.step = 1
            t = time.perf_counter()
            saver.save(state.state_dict(), Manifest("step_00000001", 1, 0, 0, 0.0, "bench", {}, 1, {}, 1, None,
                                                    None, None))
            save_s = time.perf_counter() - t
            path = checkpoint_dir(root, 1)
            files = sorted(path.glob("*.distcp"))
            size = sum(f.stat().st_size for f in files)
            floor = read_floor(files, a.cold)
            if a.cold:
                drop_caches()
            t = time.perf_counter()
            load_checkpoint(state, path, seed=0)
            load_s = time.perf_counter() - t
            rows[fmt].append({"save": save_s, "size": size, "floor": floor, "load": load_s})
            print(f"rep {rep + 1} {fmt:>3}: save {save_s:.2f} s, {size / GiB:.3f} GiB, read floor {floor:.2f} s "
                  f"({size / floor / GiB:.2f} GiB/s), verified load {load_s:.2f} s = {load_s / floor:.2f}x the read")
    med = {f: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for f, rs in rows.items()}
    for f, m in med.items():
        print(f"median {f:>3}: save {m['save']:.2f} s, {m['size'] / GiB:.3f} GiB, load {m['load']:.2f} s = "
              f"{m['load'] / m['floor']:.2f}x its read floor ({m['size'] / m['load'] / GiB:.2f} GiB/s)")
    print(f"dcp / raw: load {med['dcp']['load'] / med['raw']['load']:.2f}x, save "
          f"{med['dcp']['save'] / med['raw']['save']:.2f}x, size {med['dcp']['size'] / med['raw']['size']:.4f}x")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
