"""Checkpoint benchmark (not a test): a save's phases on the training thread and behind it, each next to
the floor measured in the same run on the same directory: async blocking, the stall of the step after it,
background persist, the verified load and what its verification adds.

  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench            # 1.5 GiB: 134M params + AdamW
  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench --dim 1024 --layers 16
  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench --format dcp   # stock DCP files, same floors
  python scripts/bench_checkpoint.py --model debug --set vocab_size=2048 intermediate_size=352      # 0.9M
  python scripts/bench_checkpoint.py --dir /tmp/ckpt-bench --dim 768 --layers 12 --vocab 8192 --against-dcp 5
      # 106M: our async save's blocking part against stock dcp.async_save with a reused stager, in turns
  python scripts/bench_checkpoint.py --model debug --set dim=256 n_layers=6 n_heads=16 n_kv_heads=16 \
      vocab_size=2048 intermediate_size=768                      # 6.2M: torchtitan's llama3 debug model

Floors (rehearsal/bench.py), each measured in turn with what it bounds, --reps times, compared by
medians: memcpy (one copy of the state's size into an already-touched buffer, as staging does) right
before each async save; write+fsync of a file of that size in --dir before each async save; a plain
sequential read of each saved checkpoint's data files, taking turns with its two cold loads (cold
when the page cache can be dropped, i.e. as root; warm otherwise).
The phases: blocking, what the training thread spends in an async save (the state dict and the
staging copy; a save the loop follows with a step runs no probe: recovery/probe.py), against a memcpy of
the state; stall, how much longer the training step right after a save takes than the steps around it
(the background persist shares the cores and the interpreter), against the same memcpy; persist against
write+fsync; the verified load against the read floor; verify, what checksum verification adds to the
load (verified minus unverified), against the time of that read floor. The step is a forward, backward
and AdamW update of --step-tokens random tokens.
With --against-dcp N, only this: N pairs of async saves taking turns, ours (CheckpointSaver, async) and stock
``torch.distributed.checkpoint.async_save`` given one ``DefaultStager`` for every save (synchronous staging
on CPU, whose cached storages are reused: the stager torch's docs tell a caller to keep), each after one
unmeasured save of its own; the blocking part is everything the training thread spends before it may
step again (ours: the state dict and the staging copy; stock: ``get_state_dict`` and ``async_save``'s
return), in wall time and in the thread's CPU time, each save's background write waited for before the next.
Targets (docs/checkpoint-format.md):
async blocking <= 1.5 x bytes / memcpy and <= 1/10 of the sync save; persist >= 0.7 x write
bandwidth; load >= 0.7 x read bandwidth. The stall and verify ratios are reported, not held to a target.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import time
from pathlib import Path

import torch

from checkpoint.durable.discovery import checkpoint_dir
from checkpoint.durable.loader import load_checkpoint
from checkpoint.durable.manifest import Manifest, checksum_files, default_algorithm
from checkpoint.durable.saver import CheckpointSaver
from checkpoint.state.training_state import TrainingState
from model.config import ModelConfig
from model.llama import build_model
from rehearsal.bench import (
    GiB,
    Memcpy,
    against,
    drop_page_cache,
    in_turns,
    model_preset,
    read_floor,
    seconds,
    write_floor,
)


def make_state(cfg: ModelConfig) -> TrainingState:
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return TrainingState(model, opt, sched)


def local_state_bytes(sd: dict) -> int:
    """Bytes of the tensors this rank holds in a state dict (its shards only)."""
    total = 0

    def walk(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            total += local.numel() * local.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)

    walk(sd)
    return total


def make_step(state: TrainingState, vocab: int, tokens: int):
    """One training step of ``state`` on ``tokens`` random tokens (forward, backward, update): what the save's
    stall is measured on."""
    rows = torch.randint(0, vocab, (1, tokens + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        return seconds(lambda: (torch.nn.functional.cross_entropy(state.model(rows[:, :-1]).flatten(0, 1),
                                                                  rows[0, 1:]).backward(),
                                state.optimizer.step(), state.optimizer.zero_grad(set_to_none=True)))
    return step


def start_save(saver: CheckpointSaver, state: TrainingState, step: int) -> float:
    """Start a save; the seconds of everything the training thread does for it (an async save's persist goes on)."""
    state.step = step
    manifest = Manifest(f"step_{step:08d}", step, 0, 0, time.time(), "bench", {}, 1, {"dp_shard": 1}, 1, None, None,
                        None)
    return seconds(lambda: saver.save(state.state_dict(), manifest))


def finished_save(saver: CheckpointSaver, blocking: float):
    """The record of the save in flight, once done, with ``blocking`` (start_save's) as its blocking_s."""
    saver.wait()
    (record,) = saver.finished()
    return dataclasses.replace(record, blocking_s=blocking)


def timed_save(saver: CheckpointSaver, state: TrainingState, step: int):
    """The save's record, with blocking_s measured around everything the training thread does."""
    return finished_save(saver, start_save(saver, state, step))


def against_dcp(state: TrainingState, root: Path, pairs: int, fmt: str, nbytes: int) -> None:
    """Our async save's blocking part against stock DCP's async_save with a reused stager (--against-dcp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    saver = CheckpointSaver(root / "ours", "async", 0, 1, storage_format=fmt)
    stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU: no pinned/shared memory, no stream
    stock_saves = 0

    def ours() -> tuple:
        cpu = time.thread_time()
        wall = start_save(saver, state, 2 + ours.n)
        cpu = time.thread_time() - cpu
        finished_save(saver, wall)
        ours.n += 1
        return wall, cpu
    ours.n = 0

    def stock() -> tuple:
        nonlocal stock_saves
        folder = root / "stock" / f"step_{stock_saves}"
        cpu, start = time.thread_time(), time.perf_counter()
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder),
                                 async_stager=stager)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        pending.result()
        shutil.rmtree(folder)
        stock_saves += 1
        return wall, cpu

    first = {"ours": ours(), "stock": stock()}  # allocate the staging buffers (later saves reuse them)
    turns = in_turns({"ours": ours, "stock": stock}, pairs)
    saver.close()
    stager.close()
    memcpy = Memcpy(nbytes)
    copy = statistics.median(memcpy.seconds() for _ in range(3))
    print(f"first saves (allocating): ours {first['ours'][0]:.3f} s, stock {first['stock'][0]:.3f} s; "
          f"memcpy of the state {copy:.3f} s")
    for name in ("ours", "stock"):
        print(f"  {name:>5} blocking, wall: " + ", ".join(f"{w:.3f}" for w, _ in turns[name])
              + " s; thread CPU: " + ", ".join(f"{c:.3f}" for _, c in turns[name]) + " s")
    med = {name: [statistics.median(v[i] for v in turns[name]) for i in (0, 1)] for name in turns}
    print(f"medians of {pairs}: blocking ours {med['ours'][0]:.3f} s, stock DCP with a reused stager "
          f"{med['stock'][0]:.3f} s: {against(med['ours'][0] / med['stock'][0], 1.0)} (wall); thread CPU "
          f"{med['ours'][1]:.3f} / {med['stock'][1]:.3f} s = {med['ours'][1] / med['stock'][1]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ckpt-bench"))
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--model", default=None, help="a preset (configs/model/NAME.yaml) instead of --dim/--layers/--vocab")
    p.add_argument("--set", nargs="*", default=[], help="the preset's fields changed: dim=256 n_layers=6 ...")
    p.add_argument("--step-tokens", type=int, default=128, help="tokens of the training step the stall is timed on")
    p.add_argument("--format", default="raw", choices=("raw", "dcp"), help="checkpoint.format")
    p.add_argument("--reps", type=int, default=3, help="cold read floor / cold load pairs")
    p.add_argument("--against-dcp", type=int, default=0, metavar="N",
                   help="only N pairs of async saves in turns: ours against stock dcp.async_save with a reused stager")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)

    cfg = (model_preset(a.model, a.set) if a.model else
           ModelConfig(name="bench", dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64, vocab_size=a.vocab,
                       max_seq_len=128))
    state = make_state(cfg)
    train_step = make_step(state, cfg.vocab_size, min(a.step_tokens, cfg.max_seq_len))
    nbytes = local_state_bytes(state.state_dict())
    print(f"state: {sum(p.numel() for p in state.model.parameters()) / 1e6:.1f} M params + AdamW = "
          f"{nbytes / GiB:.2f} GiB; checkpoint.format={a.format}; torch threads {torch.get_num_threads()}; "
          f"dir {a.dir}")

    if a.against_dcp:
        against_dcp(state, a.dir, a.against_dcp, a.format, nbytes)
        shutil.rmtree(a.dir, ignore_errors=True)
        return

    memcpy = Memcpy(nbytes)
    cold = drop_page_cache()
    print(f"floors are measured in turns with what they bound (see the docstring); reads are "
          f"{'cold' if cold else 'WARM (cannot drop the page cache: run as root for cold reads)'}")

    def sync_save(checksums: bool) -> float:
        root = a.dir / ("sync" if checksums else "nosum")
        shutil.rmtree(root, ignore_errors=True)
        kept = {} if checksums else {"checksum_algorithm": None}
        blocking = timed_save(CheckpointSaver(root, "sync", 0, 1, storage_format=a.format, **kept), state, 1).blocking_s
        if not checksums:
            shutil.rmtree(root)
        return blocking

    # in turns; the first save of a process is slower (page cache, allocator)
    sync = in_turns({"without": lambda: sync_save(False), "with": lambda: sync_save(True)}, 2)
    t_sync, t_nosum = statistics.median(sync["with"]), statistics.median(sync["without"])
    path = checkpoint_dir(a.dir / "sync", 1)
    files = sorted(path.glob("*.distcp"))
    checksum_files(files, default_algorithm())  # into the page cache
    t_sum = seconds(lambda: checksum_files(files, default_algorithm()))
    print("sync save (with checksums): " + ", ".join(f"{t:.2f}" for t in sync["with"]) + " s; without: "
          + ", ".join(f"{t:.2f}" for t in sync["without"]) + f" s; medians {t_sync:.2f} / {t_nosum:.2f} s. "
          f"Checksumming the files alone ({default_algorithm()}, page cache): {t_sum:.2f} s = "
          f"{nbytes / t_sum / GiB:.2f} GiB/s")

    def load(path: Path, verify: bool) -> float:
        if cold:
            drop_page_cache()
        return seconds(lambda: load_checkpoint(state, path, seed=0, verify=verify))

    asaver = CheckpointSaver(a.dir / "async", "async", 0, 1, storage_format=a.format)
    first = timed_save(asaver, state, 1)  # allocates the staging buffers; later saves reuse them
    rows = []
    print(f"{'rep':>3} | {'memcpy GiB/s':>12} | {'async block s':>13} | {'block/copy':>10} | {'step s':>6} | "
          f"{'stall s':>7} | {'stall/copy':>10} | {'write GiB/s':>11} | "
          f"{'persist s':>9} | {'persist/write':>13} | "
          f"{'read GiB/s':>10} | {'load s':>6} | {'load/read':>9} | {'unverified s':>12} | {'verify/read':>11}")
    for i in range(a.reps):  # in turns: a slow moment of the disk hits a floor and what it is compared with
        # write_floor deletes its file, and each checkpoint is deleted after its loads: both writes land
        # in blocks freed by the rep before.
        write_bw = write_floor(a.dir, nbytes)
        copy_bw = memcpy.bandwidth()  # right before the save it bounds
        quiet = statistics.median(train_step() for _ in range(3))  # the steps without a save behind them
        blocking = start_save(asaver, state, 2 + i)
        after = train_step()  # while the persist runs
        rec = finished_save(asaver, blocking)
        # The read floor is a plain sequential read of this checkpoint's own data files: the same blocks
        # the loads read. The three reads take turns going first.
        ckpt = checkpoint_dir(a.dir / "async", 2 + i)
        files = sorted(ckpt.glob("*.distcp"))
        reads = in_turns({"read": lambda: read_floor(files, cold), "load": lambda: load(ckpt, True),
                          "unverified": lambda: load(ckpt, False)}, 1, shift=i)
        row = {k: v[0] for k, v in reads.items()}
        row.update(memcpy=copy_bw, write=write_bw, block=rec.blocking_s, persist=rec.background_s, step=quiet,
                   stall=max(0.0, after - quiet))
        shutil.rmtree(ckpt)
        rows.append(row)
        print(f"{i + 1:>3} | {copy_bw / GiB:>12.2f} | {row['block']:>13.3f} | "
              f"{row['block'] * copy_bw / nbytes:>10.2f} | {quiet:>6.3f} | {row['stall']:>7.3f} | "
              f"{row['stall'] * copy_bw / nbytes:>10.2f} | {write_bw / GiB:>11.2f} | {row['persist']:>9.2f} | "
              f"{nbytes / row['persist'] / write_bw:>13.2f} | {row['read'] / GiB:>10.2f} | {row['load']:>6.2f} | "
              f"{nbytes / row['load'] / row['read']:>9.2f} | {row['unverified']:>12.2f} | "
              f"{(row['load'] - row['unverified']) * row['read'] / nbytes:>11.2f}")
    asaver.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    load_checkpoint(state, path, seed=0)  # fills the page cache
    warm = seconds(lambda: load_checkpoint(state, path, seed=0))
    print(f"medians of {a.reps} (the reads take turns going first: read floor, verified load, unverified load):")
    print(f"  async blocking {med['block']:.3f} s, against the memcpy floor "
          f"{against(med['block'] * med['memcpy'] / nbytes, 1.5)}, against the sync save "
          f"{against(med['block'] / t_sync, 0.1)}; first save (allocating buffers) {first.blocking_s:.3f} s")
    print(f"  stall of the step after a save {med['stall']:.3f} s (a step {med['step']:.3f} s), against the memcpy "
          f"floor {med['stall'] * med['memcpy'] / nbytes:.2f}x")
    print(f"  persist {med['persist']:.2f} s = {nbytes / med['persist'] / GiB:.2f} GiB/s, against the write+fsync "
          f"floor {against(nbytes / med['persist'] / med['write'], 0.7, at_most=False)}")
    print(f"  load, checksums verified, {'cold' if cold else 'warm'}: {med['load']:.2f} s = "
          f"{nbytes / med['load'] / GiB:.2f} GiB/s, against the read floor "
          f"{against(nbytes / med['load'] / med['read'], 0.7, at_most=False)}; unverified {med['unverified']:.2f} s; "
          f"from the page cache {warm:.2f} s; verification adds {med['load'] - med['unverified']:.2f} s = "
          f"{(med['load'] - med['unverified']) * med['read'] / nbytes:.2f}x the read floor's time")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
