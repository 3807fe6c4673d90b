"""Checkpoint benchmark (not a test): save, async blocking, background persist and load times of a
>= 1 GB training state, each next to the floor measured in the same run on the same directory.

  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench            # 1.5 GiB: 134M params + AdamW
  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench --dim 1024 --layers 16

Floors, each measured in turn with what it bounds, --reps times, compared by medians (a
shared VM's disk moves by 2x from one second to the next; its memory bandwidth by 1.5x):
memcpy (one copy of the state's size into an already-touched buffer, as staging does) right
before each async save; write+fsync of a file of that size in --dir before each async save;
a plain sequential read of each saved checkpoint's data files, taking turns with its two cold
loads (cold when the page cache can be dropped, i.e. as root; warm otherwise).
Targets (docs/checkpoint-format.md):
async blocking <= 1.5 x bytes / memcpy and <= 1/10 of the sync save; persist >= 0.7 x write
bandwidth; load >= 0.7 x read bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import List

import torch

from checkpoint.durable.integrity import checksum_files, default_algorithm
from checkpoint.durable.layout import checkpoint_dir
from checkpoint.durable.loader import load_checkpoint
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.state.training_state import TrainingState, local_state_bytes
from model.config import ModelConfig
from model.llama import build_model

GiB = 2**30


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Memcpy:
    """The copy floor: one copy of ``nbytes`` into an already-touched buffer (median of 3)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4, dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # touch

    def bandwidth(self) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            self.dst.copy_(self.src)
            times.append(time.perf_counter() - t)
        return self.nbytes / statistics.median(times)


def write_floor_file(directory: Path, nbytes: int) -> tuple:
    """(path, write+fsync bandwidth) of a file of ``nbytes`` random bytes written in ``directory``."""
    path = directory / "floor.bin"
    chunk = bytearray(os.urandom(1 << 20)) * 64  # 64 MiB
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(chunk)
        os.fsync(f.fileno())
    return path, written / (time.perf_counter() - t)


def read_bandwidth(paths: List[Path], cold: bool) -> float:
    """One sequential pass over ``paths`` in 64 MiB reads (what ``cat`` achieves)."""
    if cold:
        drop_caches()
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return sum(p.stat().st_size for p in paths) / (time.perf_counter() - t)


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


def load_warm(state: TrainingState, path: Path) -> float:
    load_checkpoint(state, path, seed=0)  # fills the page cache
    t = time.perf_counter()
    load_checkpoint(state, path, seed=0)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ckpt-bench"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3, help="cold read floor / cold load pairs")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)

    state = make_state(a.dim, a.layers, a.vocab)
    nbytes = local_state_bytes(state.state_dict())
    print(f"state: {sum(p.numel() for p in state.model.parameters()) / 1e6:.1f} M params + AdamW = "
          f"{nbytes / GiB:.2f} GiB; torch threads {torch.get_num_threads()}; dir {a.dir}")

    memcpy = Memcpy(nbytes)
    cold = drop_caches()
    print(f"floors are measured in turns with what they bound (see the docstring); reads are "
          f"{'cold' if cold else 'WARM (cannot drop the page cache: run as root for cold reads)'}")

    sums, nosums = [], []
    for i in range(2):  # in turns; the first save of a process is slower (page cache, allocator)
        nosums.append(timed_save(CheckpointSaver(a.dir / f"nosum{i}", "sync", 0, 1, checksum_algorithm=None),
                                 state, 1).blocking_s)
        shutil.rmtree(a.dir / f"nosum{i}")
        sums.append(timed_save(CheckpointSaver(a.dir / f"sync{i}", "sync", 0, 1), state, 1).blocking_s)
    t_sync, t_nosum = statistics.median(sums), statistics.median(nosums)
    path = checkpoint_dir(a.dir / "sync1", 1)
    files = sorted(path.glob("*.distcp"))
    checksum_files(files, default_algorithm())  # into the page cache
    t = time.perf_counter()
    checksum_files(files, default_algorithm())
    t_sum = time.perf_counter() - t
    print("sync save (with checksums): " + ", ".join(f"{t:.2f}" for t in sums) + " s; without: "
          + ", ".join(f"{t:.2f}" for t in nosums) + f" s; medians {t_sync:.2f} / {t_nosum:.2f} s. "
          f"Checksumming the files alone ({default_algorithm()}, page cache): {t_sum:.2f} s = "
          f"{nbytes / t_sum / GiB:.2f} GiB/s")

    def load(path: Path, verify: bool) -> float:
        if cold:
            drop_caches()
        t = time.perf_counter()
        load_checkpoint(state, path, seed=0, verify=verify)
        return time.perf_counter() - t

    asaver = CheckpointSaver(a.dir / "async", "async", 0, 1)
    first = timed_save(asaver, state, 1)  # allocates the staging buffers; later saves reuse them
    rows = []
    print(f"{'rep':>3} | {'memcpy GiB/s':>12} | {'async block s':>13} | {'block/copy':>10} | {'write GiB/s':>11} | "
          f"{'persist s':>9} | {'persist/write':>13} | "
          f"{'read GiB/s':>10} | {'load s':>6} | {'load/read':>9} | {'unverified s':>12}")
    for i in range(a.reps):  # in turns: a slow moment of the disk hits a floor and what it is compared with
        # On a thin-provisioned virtual disk, writing never-used blocks measured 2x slower than
        # writing freed ones: the floor file is deleted before the save and the checkpoint after
        # its loads, so both writes land in blocks freed by the rep before.
        floor_file, write_bw = write_floor_file(a.dir, nbytes)
        floor_file.unlink()
        copy_bw = memcpy.bandwidth()  # right before the save it bounds
        rec = timed_save(asaver, state, 2 + i)
        # The read floor is a plain sequential read of this checkpoint's own data files: the
        # same blocks the loads read. The three reads take turns going first.
        ckpt = checkpoint_dir(a.dir / "async", 2 + i)
        files = sorted(ckpt.glob("*.distcp"))
        reads = {"read": lambda: read_bandwidth(files, cold), "load": lambda: load(ckpt, True),
                 "unverified": lambda: load(ckpt, False)}
        order = list(reads)[i % 3:] + list(reads)[:i % 3]
        row = {k: reads[k]() for k in order}
        row.update(memcpy=copy_bw, write=write_bw, block=rec.blocking_s, persist=rec.background_s)
        shutil.rmtree(ckpt)
        read_bw = row["read"]
        rows.append(row)
        block_ratio = row['block'] * copy_bw / nbytes
        print(f"{i + 1:>3} | {copy_bw / GiB:>12.2f} | {row['block']:>13.3f} | {block_ratio:>10.2f} | "
              f"{write_bw / GiB:>11.2f} | {row['persist']:>9.2f} | "
              f"{nbytes / row['persist'] / write_bw:>13.2f} | {read_bw / GiB:>10.2f} | {row['load']:>6.2f} | "
              f"{nbytes / row['load'] / read_bw:>9.2f} | {row['unverified']:>12.2f}")
    asaver.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"medians of {a.reps} (the reads take turns going first: read floor, verified load, unverified load):")
    print(f"  async blocking {med['block']:.3f} s = {med['block'] * med['memcpy'] / nbytes:.2f}x bytes/memcpy "
          f"(target <= 1.5x) = {med['block'] / t_sync:.3f} of the sync save (target <= 0.1); first save "
          f"(allocating buffers) {first.blocking_s:.3f} s")
    print(f"  persist {med['persist']:.2f} s = {nbytes / med['persist'] / GiB:.2f} GiB/s = "
          f"{nbytes / med['persist'] / med['write']:.2f}x write+fsync bandwidth (target >= 0.7)")
    print(f"  load, checksums verified, {'cold' if cold else 'warm'}: {med['load']:.2f} s = "
          f"{nbytes / med['load'] / GiB:.2f} GiB/s = {nbytes / med['load'] / med['read']:.2f}x read bandwidth "
          f"(target >= 0.7); unverified {med['unverified']:.2f} s; from the page cache {load_warm(state, path):.2f} s")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
