"""Checkpoint benchmark (not a test): save, async blocking, background persist and load times of a
>= 1 GB training state, each next to the floor measured in the same run on the same directory.

  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench            # ~1.1 GB: 94M params + AdamW
  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench --dim 1024 --layers 16

Floors: host memcpy bandwidth (copy into an already-touched buffer, as staging does), write
bandwidth of a file written and fsynced in --dir, read bandwidth of that file (cold when the page
cache can be dropped, i.e. as root; warm otherwise; both are printed). Targets (docs/checkpoint-format.md):
async blocking <= 1.5 x bytes / memcpy and <= 1/10 of the sync save; persist >= 0.7 x write
bandwidth; load >= 0.7 x read bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint.integrity import checksum_files, default_algorithm  # noqa: E402
from checkpoint.layout import committed_dir  # noqa: E402
from checkpoint.loader import load_checkpoint  # noqa: E402
from checkpoint.manifest import Manifest  # noqa: E402
from checkpoint.saver import CheckpointSaver  # noqa: E402
from checkpoint.state import TrainingState, local_state_bytes  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.llama import build_model  # noqa: E402

GiB = 2**30


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def memcpy_bandwidth(nbytes: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)  # the median, like the timings it is compared with


def write_read_bandwidth(directory: Path, nbytes: int) -> tuple:
    path = directory / "floor.bin"
    chunk = bytearray(os.urandom(1 << 20)) * 64  # 64 MiB
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(chunk)
        os.fsync(f.fileno())
    write_bw = written / (time.perf_counter() - t)
    reads = {}
    for kind in ("cold", "warm"):
        if kind == "cold" and not drop_caches():
            continue
        buf = bytearray(64 << 20)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        reads[kind] = written / (time.perf_counter() - t)
    path.unlink()
    return write_bw, reads


def make_state(dim: int, layers: int, vocab: int) -> TrainingState:
    cfg = ModelConfig(name="bench", dim=dim, n_layers=layers, n_heads=dim // 64, vocab_size=vocab, max_seq_len=128)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return TrainingState(model, opt, sched)


def manifest(step: int) -> Manifest:
    return Manifest(f"step_{step:08d}", step, 0, 0, time.time(), "bench", {}, 1, {"dp_shard": 1}, 1, None, None,
                    None)


def timed_save(saver: CheckpointSaver, state: TrainingState, step: int):
    """The save's record, with blocking_s measured around everything the training thread does."""
    state.step = step
    t = time.perf_counter()
    saver.save(state.state_dict(), manifest(step))
    blocking = time.perf_counter() - t
    saver.wait()
    (record,) = saver.finished()
    record.blocking_s = blocking
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ckpt-bench"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)

    state = make_state(a.dim, a.layers, a.vocab)
    nbytes = local_state_bytes(state.state_dict())
    print(f"state: {sum(p.numel() for p in state.model.parameters()) / 1e6:.1f} M params + AdamW = "
          f"{nbytes / GiB:.2f} GiB; torch threads {torch.get_num_threads()}; dir {a.dir}")

    memcpy = memcpy_bandwidth(nbytes)
    write_bw, reads = write_read_bandwidth(a.dir, nbytes)
    read_kind = "cold" if "cold" in reads else "warm"
    read_bw = reads[read_kind]
    print(f"floors: memcpy {memcpy / GiB:.2f} GiB/s | write+fsync {write_bw / GiB:.2f} GiB/s | read "
          + " / ".join(f"{k} {v / GiB:.2f} GiB/s" for k, v in reads.items()))

    sync_plain = CheckpointSaver(a.dir / "nosum", "sync", 0, 1, checksum_algorithm=None)
    t_nosum = timed_save(sync_plain, state, 1).blocking_s
    sync = CheckpointSaver(a.dir / "sync", "sync", 0, 1)
    t_sync = timed_save(sync, state, 1).blocking_s
    files = sorted(committed_dir(a.dir / "sync", 1).glob("*.distcp"))
    t = time.perf_counter()
    checksum_files(files, default_algorithm())
    t_sum = time.perf_counter() - t
    print(f"sync save:  {t_sync:.2f} s = {nbytes / t_sync / GiB:.2f} GiB/s; without checksums {t_nosum:.2f} s. "
          f"Checksumming the files alone ({default_algorithm()}, page cache): {t_sum:.2f} s = "
          f"{nbytes / t_sum / GiB:.2f} GiB/s = {t_sum / t_sync:.0%} of the sync save")

    asaver = CheckpointSaver(a.dir / "async", "async", 0, 1)
    first = timed_save(asaver, state, 1)
    recs = [timed_save(asaver, state, step) for step in (2, 3, 4)]  # staging buffers reused
    asaver.close()
    blocking = statistics.median(r.blocking_s for r in recs)
    persist = statistics.median(r.background_s for r in recs)
    floor_block = nbytes / memcpy
    persist_bw = nbytes / persist
    print(f"async save (median of 3): blocking {blocking:.3f} s (first save, allocating buffers: "
          f"{first.blocking_s:.3f} s); bytes/memcpy {floor_block:.3f} s -> {blocking / floor_block:.2f}x "
          f"(target <= 1.5x); {blocking / t_sync:.3f} of sync (target <= 0.1)")
    print(f"            background persist {persist:.2f} s = {persist_bw / GiB:.2f} GiB/s = "
          f"{persist_bw / write_bw:.2f}x write bandwidth (target >= 0.7)")

    path = committed_dir(a.dir / "sync", 1)
    loads = {}
    for verify in (True, False):
        for kind in ("cold", "warm"):
            if kind == "cold" and not drop_caches():
                continue
            t = time.perf_counter()
            load_checkpoint(state, path, seed=0, verify=verify)
            loads[(kind, verify)] = time.perf_counter() - t
    t_load = loads[(read_kind, True)]
    print(f"load ({read_kind}, checksums verified): {t_load:.2f} s = {nbytes / t_load / GiB:.2f} GiB/s = "
          f"{nbytes / t_load / read_bw:.2f}x {read_kind} read bandwidth (target >= 0.7)")
    print("load times: " + ", ".join(f"{k} {'verified' if v else 'unverified'} {t:.2f} s" for (k, v), t in loads.items()))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
