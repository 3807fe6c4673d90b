"""Memory-tier benchmark (not a test): what checkpoint.memory costs a training run and what it saves
on a restart, on bench_checkpoint.py's 134M-parameter state at 2 ranks, each next to its floor
measured in the same run.

  python scripts/bench_memory_tier.py --out outputs/bench_memory_tier              # 134M params, ~15-25 min
  python scripts/bench_memory_tier.py --out /tmp/mt --dim 64 --layers 2 --vocab 320 --steps 22   # smoke
  python scripts/bench_memory_tier.py --out /tmp/mt --floors-only   # part 3 alone, ~3 min

Every run is two torchrun agents on this host playing two nodes: one worker each, c10d
rendezvous on 127.0.0.1 (node 0 hosts the store: --rdzv-conf is_host=true/false),
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and checkpoint.memory.node=0/1 so each node has its own
directory under a per-run memory root in --shm (removed at the end): a replica really crosses
"nodes" (rank r's copy goes to the other agent's directory over the tier's gloo group). The
model is the debug experiment's reshaped to --dim/--layers/--vocab (FSDP over the 2 ranks, so
each rank snapshots half of the state), trained on the debug experiment's text (--data, prepared
by rehearsal.runs.prepare_debug_data when missing) with evaluation off. Durable checkpoints are
async, on disk under --out.

1. Throughput, one run per configuration of --steps steps: no checkpointing (first and again
   last: their spread is the run-to-run noise); durable only (checkpoint.interval=10); the memory
   tier at intervals 1, 5 and 10 (replicas=1) with the durable tier OFF, so the rows isolate the
   tier's cost. A step's wall time is the time between consecutive per-step rows of
   metrics.jsonl (timestamped as they appear): unlike the rows' step_s it includes the snapshot
   stall and the durable save's blocking, which happen after step_s's clock stops. Throughput is
   the mean wall time per step after --warmup steps (the stalls are every k-th step: a median
   would hide them); the median step_s (the compute, slowed by the background threads) is beside it.
2. Snapshot stall (the training thread: building the snapshot's manifest, which runs no probe,
   waiting for the previous snapshot, the copy into the staging buffer; median over the run's
   snapshots after the first, rank 0's: the first allocates the reused staging buffer, and its
   stall is printed apart, as bench_checkpoint.py prints an async save's first blocking time)
   against the memcpy floor of the same bytes (rehearsal/bench.py, measured by this process right
   after each memory run, median); the background time beside the floor sum below.
3. Replica bandwidth in training (replica_bytes / replica_s: the exchange with the peer, writing
   the replica to tmpfs and its checksum, while the other rank trains) against the gloo floor; then
   one snapshot on its own (floor_worker: two processes, the state shaped like a rank's, the tier's
   own code: stage, write + checksum, exchange, commit; --reps times after two that allocate the
   buffers and the files the later ones write over (the steady state of a run), median), its wall
   and CPU time (the whole process: gloo's threads and the kernel
   included), and, by the same two processes right after, the floors for the same bytes: memcpy,
   xxh3, a tmpfs write and a gloo point-to-point exchange both ways at once, each in wall and CPU
   seconds. Background target: the snapshot's CPU against the sum of the floors' CPU (what a loaded
   machine inflates least); the walls are beside it.
4. Restore, memory interval 5 and durable interval 10, one snapshot newer than the durable
   checkpoint (step 15 against step 10); each timed from the restart to the first resumed step's
   metrics row, and by the resume event's load_s (load + verification; for the memory tier its
   verify/read/apply/check split) and the log's "resume took":
   (a) worker crash: rank 1 SIGKILLed by recovery.faults at step 19 (--max-restarts 1): torchrun
       restarts both workers, both restore from their own node; timed from the kill;
   (b) local, full restart: the job stopped (every process SIGKILLed) once rank 0 has logged the
       snapshot of step 15 committed, restarted with both nodes' memory intact;
   (c) peer: the same stopped job with node 1's memory directory deleted: its rank streams its
       copy from the replica on node 0;
   (d) durable, cold: the same stopped job with both nodes' memory deleted: the durable load, with
       the page cache dropped first (as root).
   (b)-(d) restart from the same copy of the stopped job (run directory and memory restored from a
   backup on disk before each); before each the page cache is dropped and then torch and the
   trainer are imported once, so their start-up is alike and only (d)'s checkpoint is cold.
Targets (issues 16 and 22), each printed with its verdict: at memory interval 10, throughput
within 3% of no checkpointing (beside the none-vs-none noise); the replica at least 0.5x the gloo
floor; the stall at most 1.5x the memcpy floor; one snapshot's background CPU at most 2x the floor
sum (memcpy + xxh3 + tmpfs write + gloo); a restore from local memory at least 2x faster than a
cold durable load (resume load_s, (b) against (d): each ends with its own post-load verification,
step and LR on both sides; the memory restore then compares every applied tensor with the snapshot's
bytes (check_s), the durable load runs the probe's forward, whose seconds (the verification's log
line) are printed beside it with the ratio without them). The replica and the stall are judged on
the training run at interval 10, the snapshot on its own beside them.
The table is printed; everything is written to --out/result.json.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from rehearsal import processes
from rehearsal.bench import GiB, Memcpy, MetricsTail, against, drop_page_cache, resumed

ROOT = Path(__file__).resolve().parent.parent
DURABLE_INTERVAL = 10
MEMORY_INTERVALS = (1, 5, 10)
RESTORE_MEMORY_INTERVAL, RESTORE_SNAPSHOT, CRASH_STEP = 5, 15, 19
# Run before each restart, after the page cache is dropped: what every worker imports comes back from disk.
WARM_IMPORTS = [sys.executable, "-c", "import torch.distributed.run, hydra, trainer.run"]


def child_env() -> Dict[str, str]:
    return processes.child_env({"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def kill_all(procs: List[subprocess.Popen]) -> None:
    """SIGKILL the agents and every process they started, then reap the agents."""
    processes.kill_tree(*(p.pid for p in procs if p.poll() is None))
    for proc in procs:
        proc.wait()


class Launch:
    """One launch of the two agents; ``rows``: (arrival time, row) of the lines it added to metrics.jsonl."""

    def __init__(self, tag: str, t_start: float, codes: List[Optional[int]], rows: list, logs: List[Path]):
        self.tag, self.t_start, self.codes, self.rows, self.logs = tag, t_start, codes, rows, logs

    def steps(self) -> List[tuple]:
        return [(t, r) for t, r in self.rows if "kind" not in r]

    def events(self, kind: str) -> List[tuple]:
        return [(t, r) for t, r in self.rows if r.get("kind") == kind]

    def text(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-tail:]}" for p in self.logs)


class Bench:
    def __init__(self, a):
        self.a = a
        self.runs, self.logs = a.out / "runs", a.out / "logs"
        self.n_heads = max(1, a.dim // 64)

    def overrides(self, run_dir: Path, steps: int, durable: int, memory: int, extra=()) -> List[str]:
        from rehearsal.runs import debug_overrides

        return debug_overrides(run_dir, self.a.data, steps, [
            f"model.dim={self.a.dim}", f"model.n_layers={self.a.layers}", f"model.n_heads={self.n_heads}",
            "model.n_kv_heads=null", f"model.vocab_size={self.a.vocab}", "eval.interval=0",
            f"checkpoint.interval={durable}", "checkpoint.async_mode=async", "checkpoint.keep_last=2",
            "checkpoint.save_final=false", f"checkpoint.memory.interval={memory}", "checkpoint.memory.replicas=1",
            f"checkpoint.memory.root={self.a.shm / run_dir.name}", *extra])

    def launch(self, tag: str, run_dir: Path, overrides: List[str], max_restarts: int = 0,
               stop_when: Optional[Callable[[list], bool]] = None) -> Launch:
        """Both agents; until they exit, or until ``stop_when(rows)`` (then every process is SIGKILLed)."""
        from metrics.records import read_rows

        port, known = processes.free_port(), len(read_rows(run_dir))
        tail = MetricsTail(run_dir / "metrics.jsonl")
        tail.start()
        procs, logs = [], []
        t_start = time.time()
        try:
            for node in (0, 1):
                logs.append(self.logs / f"{tag}-node{node}.log")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={tag}",
                       f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}", f"--max-restarts={max_restarts}",
                       "--monitor-interval=0.5", str(ROOT / "train.py"), *overrides, f"checkpoint.memory.node={node}"]
                with open(logs[-1], "w") as log:
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
                if node == 0:
                    time.sleep(1.0)  # node 0 hosts the rendezvous store
            deadline = time.monotonic() + self.a.timeout
            while any(p.poll() is None for p in procs):
                if stop_when is not None and stop_when(tail.rows[known:]):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tag}: still running after {self.a.timeout} s")
                time.sleep(0.02)
        finally:
            kill_all(procs)
            time.sleep(0.05)
            tail.stop()
        return Launch(tag, t_start, [p.returncode for p in procs], tail.rows[known:], logs)

    # -- 1. throughput ---------------------------------------------------------------------------
    def throughput(self, name: str, durable: int, memory: int) -> dict:
        run_dir = self.runs / f"tp-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        job = self.launch(f"tp-{name}", run_dir, self.overrides(run_dir, self.a.steps, durable, memory))
        steps = {r["step"]: (t, r) for t, r in job.steps()}
        if any(c != 0 for c in job.codes) or sorted(steps) != list(range(1, self.a.steps + 1)):
            raise RuntimeError(f"{name}: exit codes {job.codes}, steps {sorted(steps)}\n{job.text()}")
        w, n = self.a.warmup, self.a.steps
        walls = [steps[s][0] - steps[s - 1][0] for s in range(w + 1, n + 1)]
        step_s = [steps[s][1]["step_s"] for s in range(w + 1, n + 1)]
        snaps = [r for _, r in job.events("memory_snapshot")]
        saves = [r for _, r in job.events("checkpoint")]
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(self.a.shm / run_dir.name, ignore_errors=True)
        out = {"durable_interval": durable, "memory_interval": memory, "steps_measured": len(walls),
               "wall_per_step_s": statistics.fmean(walls), "median_wall_s": statistics.median(walls),
               "max_wall_s": max(walls), "median_step_s": statistics.median(step_s),
               "durable_saves": len(saves), "snapshots": snaps,
               "durable_blocking_s": [r.get("blocking_s") for r in saves]}
        print(f"  {name:<12} {out['wall_per_step_s']:.3f} s/step (median step_s {out['median_step_s']:.3f}, "
              f"{len(snaps)} snapshots, {len(saves)} durable saves)", flush=True)
        return out

    # -- 4. restore --------------------------------------------------------------------------------
    @staticmethod
    def _first_resumed_step(rows: list) -> bool:
        return resumed(rows) is not None

    @staticmethod
    def _logged(job: Launch, pattern: str) -> Optional[float]:
        """The last number ``pattern`` finds in the job's logs."""
        text = "\n".join(p.read_text(errors="replace") for p in job.logs)
        found = [float(m) for m in re.findall(pattern, text)]
        return found[-1] if found else None

    def _restore_record(self, job: Launch, t_failure: float) -> dict:
        if resumed(job.rows) is None:
            raise RuntimeError(f"{job.tag}: no resumed step (exit codes {job.codes})\n{job.text()}")
        t_resume, ev, t_first = resumed(job.rows)
        keys = ("step", "source", "sources", "load_s", "verify_s", "read_s", "apply_s", "check_s", "total_s")
        return {**{k: ev.get(k) for k in keys}, "resume_took_s": self._logged(job, r"resume took ([\d.]+) s"),
                "probe_s": self._logged(job, r"post-load verification .* passed: .*\(probe ([\d.]+) s\)"),
                "to_resume_event_s": t_resume - t_failure, "to_first_step_s": t_first - t_failure}

    def crash(self) -> dict:
        """(a) rank 1 SIGKILLed at CRASH_STEP, torchrun restarts the workers (--max-restarts 1)."""
        from rehearsal.chains import faults_override, fired_at

        run_dir = self.runs / "restore-crash"
        shutil.rmtree(run_dir, ignore_errors=True)
        fault = faults_override([{"kind": "sigkill", "phase": "data_wait", "step": CRASH_STEP, "rank": 1}])
        job = self.launch("restore-crash", run_dir, self.overrides(
            run_dir, CRASH_STEP + 1, DURABLE_INTERVAL, RESTORE_MEMORY_INTERVAL, [fault]), max_restarts=1,
            stop_when=self._first_resumed_step)
        out = self._restore_record(job, fired_at(run_dir))
        print(f"  crash_local    resumed step {out['step']} from {out['source']} {out['sources']}: load "
              f"{out['load_s']} s", flush=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(self.a.shm / run_dir.name, ignore_errors=True)
        return out

    def restarts(self, drop) -> Dict[str, dict]:
        """(b)-(d): one stopped job, restarted three times from a backup of it."""
        run_dir = self.runs / "restore-stopped"
        shm, backup = self.a.shm / run_dir.name, self.a.out / "backup"
        for d in (run_dir, shm, backup):
            shutil.rmtree(d, ignore_errors=True)
        args = self.overrides(run_dir, CRASH_STEP + 1, DURABLE_INTERVAL, RESTORE_MEMORY_INTERVAL)

        def snapshot_committed(rows: list) -> bool:
            return any(r.get("kind") == "memory_snapshot" and r["step"] == RESTORE_SNAPSHOT and r["committed"]
                       for _, r in rows)

        job = self.launch("restore-stopped", run_dir, args, stop_when=snapshot_committed)
        if not snapshot_committed(job.rows):
            raise RuntimeError(f"the stopped job ended before its snapshot of step {RESTORE_SNAPSHOT} committed "
                               f"(exit codes {job.codes})\n{job.text()}")
        shutil.copytree(run_dir, backup / "run")
        shutil.copytree(shm, backup / "shm")
        out = {}
        for name, delete in (("local_restart", []), ("peer", ["node-1"]), ("durable_cold", ["node-0", "node-1"])):
            for d in (run_dir, shm):
                shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(backup / "run", run_dir)
            shutil.copytree(backup / "shm", shm)
            for node in delete:
                shutil.rmtree(shm / node)
            cold = drop()
            subprocess.run(WARM_IMPORTS, cwd=ROOT, env=child_env(), check=True)  # alike start-ups: only data is cold
            job = self.launch(f"restore-{name}", run_dir, args, stop_when=self._first_resumed_step)
            out[name] = {**self._restore_record(job, job.t_start), "page_cache_dropped": cold}
            print(f"  {name:<14} resumed step {out[name]['step']} from {out[name]['source']} "
                  f"{out[name]['sources']}: load {out[name]['load_s']} s", flush=True)
        for d in (run_dir / "checkpoints", shm, backup):
            shutil.rmtree(d, ignore_errors=True)
        return out


# -- 3. the floors and one snapshot on its own ------------------------------------------------------
def rank_state(dim: int, layers: int, vocab: int, n_heads: int, rank: int) -> dict:
    """A state dict shaped like one rank's training state: every parameter's FSDP shard (dim 0 split
    over 2 ranks) and its AdamW moments, in float32, and some pickled components."""
    import torch

    from model.config import ModelConfig
    from model.llama import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(dim=dim, n_layers=layers, n_heads=n_heads, vocab_size=vocab))
    gen = torch.Generator().manual_seed(rank)
    params, moments = {}, {}
    for name, p in model.named_parameters():
        rows = p.shape[0] - p.shape[0] // 2 if rank == 0 else p.shape[0] // 2
        shape = (rows, *p.shape[1:])
        params[name] = torch.randn(shape, generator=gen)
        moments[name] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(shape, generator=gen),
                         "exp_avg_sq": torch.rand(shape, generator=gen)}
    return {"model": params, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
            "extra": {"rng": os.urandom(5000), "data": os.urandom(200)}}


def floor_worker(rank: int, port: int, model: str, reps: int, shm: Path, out: Path) -> None:
    """One of two processes: one snapshot of a state like the training run's, taken by the memory tier's
    own code (stage, write + checksum, replica exchange, commit) ``reps`` times with nothing else
    running (after two that allocate the buffers and the spare files: ``first_snapshots``), its wall
    and CPU time (the whole process: the gloo threads and the kernel included);
    then the floors for the same bytes: xxh3, a tmpfs write, a gloo exchange both ways at once."""
    import resource
    import types

    import torch
    import torch.distributed as dist

    from checkpoint.durable.manifest import hasher
    from checkpoint.memory.tier import MemoryTier, persist
    from rehearsal.bench import CHUNK  # the floors' own chunk, not the tier's: the floors do not move with the code

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dim, layers, vocab, n_heads = (int(x) for x in model.split(","))
    sd = rank_state(dim, layers, vocab, n_heads, rank)
    mcfg = types.SimpleNamespace(root=str(shm), node=rank, interval=1, replicas=1)
    tier = MemoryTier(mcfg, run_name="floors", rank=rank, world_size=2, local_world_size=1, layout={"dp_shard": 2},
                      config_hash="bench", algorithm="xxh3_64")
    snaps = []
    for step in range(1, reps + 3):  # the first two allocate the buffers and the spare files: left out
        dist.barrier()
        c0, t0 = cpu(), time.perf_counter()
        staged = tier.stager.stage(sd)
        c1, t1 = cpu(), time.perf_counter()
        rec = persist(tier, step, staged, {"step": step, "owner": rank, "algorithm": "xxh3_64"}, t1 - t0, 0.0)
        c2, t2 = cpu(), time.perf_counter()
        if not rec.committed:
            raise RuntimeError(f"floor worker: the snapshot of step {step} did not commit")
        snaps.append({"bytes": rec.bytes, "stage_s": t1 - t0, "stage_cpu_s": c1 - c0, "background_s": t2 - t1,
                      "replica_s": rec.replica_s, "transfer_s": getattr(rec, "transfer_s", 0.0), "cpu_s": c2 - c0})
    nbytes = snaps[0]["bytes"]
    tier.close()
    del sd, staged
    shutil.rmtree(tier.dir, ignore_errors=True)
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = torch.ones(nbytes, dtype=torch.uint8)  # touched
    view = memoryview(send.numpy())
    floors: Dict[str, list] = {}
    scratch = shm / f"floor-{rank}.bin"

    def timed(name: str, fn) -> None:  # wall and CPU (the whole process's: gloo's threads and the kernel too)
        c, t = cpu(), time.perf_counter()
        fn()
        floors.setdefault(name, []).append(time.perf_counter() - t)
        floors.setdefault(name.replace("_s", "_cpu_s"), []).append(cpu() - c)

    def exchange() -> None:
        for work in (dist.isend(send, 1 - rank), dist.irecv(recv, 1 - rank)):
            work.wait()

    def checksum() -> None:
        h = hasher("xxh3_64")
        for start in range(0, nbytes, CHUNK):
            h.update(view[start:start + CHUNK])
        h.hexdigest()

    def write(mode: str = "wb") -> None:
        with open(scratch, mode, buffering=0) as f:
            for start in range(0, nbytes, CHUNK):
                piece = view[start:start + CHUNK]
                while len(piece):
                    piece = piece[f.write(piece):]

    for _ in range(reps + 1):  # the first one warms the connection and the pages
        dist.barrier()
        timed("gloo_s", exchange)
        timed("memcpy_s", lambda: recv.copy_(send))
        timed("xxh3_s", checksum)
        timed("tmpfs_write_s", write)
        timed("tmpfs_overwrite_s", lambda: write("r+b"))  # over the pages the file holds: the tier's spares
        scratch.unlink()
    dist.barrier()
    if rank == 0:
        out.write_text(json.dumps({"bytes": nbytes, "snapshots": snaps[2:], "first_snapshots": snaps[:2],
                                   **{k: v[1:] for k, v in floors.items()}}))
    dist.destroy_process_group()


def floors_and_snapshot(a, n_heads: int, out: Path) -> dict:
    """floor_worker's measurements (rank 0's), from two processes on this host."""
    port = processes.free_port()
    shm = a.shm / "floors"
    model = f"{a.dim},{a.layers},{a.vocab},{n_heads}"
    procs = [subprocess.Popen([sys.executable, __file__, "--floor-worker", str(rank), str(port), model, str(a.reps),
                               str(shm), str(out)], cwd=ROOT, env=child_env()) for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=1200) for p in procs]
    finally:
        kill_all(procs)
        shutil.rmtree(shm, ignore_errors=True)
    if codes != [0, 0]:
        raise RuntimeError(f"floor worker: exit codes {codes}")
    res = json.loads(out.read_text())
    out.unlink()
    return res


# -- the report ------------------------------------------------------------------------------------
def median_of(rows: List[dict], key: str) -> Optional[float]:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def snapshot_summary(snaps: List[dict], memcpy_bw: float, gloo_bw: float, floor_sum_bw: float) -> dict:
    nbytes = snaps[0]["bytes"]
    replica_bw = [r["replica_bytes"] / r["replica_s"] for r in snaps if r.get("replica_s")]
    steady = snaps[1:] or snaps  # the first snapshot allocates the staging buffer: its stall is apart
    stall = median_of(steady, "stall_s")
    waited = median_of(steady, "waited_s")
    floor = nbytes / memcpy_bw
    out = {"count": len(snaps), "committed": sum(bool(r["committed"]) for r in snaps), "bytes": nbytes,
           "replica_bytes": snaps[0]["replica_bytes"], "stall_s": stall, "first_stall_s": snaps[0]["stall_s"],
           "waited_s": waited, "copy_s": median_of([{"c": r["stall_s"] - r["waited_s"]} for r in steady], "c"),
           "background_s": median_of(snaps, "background_s"), "replica_s": median_of(snaps, "replica_s"),
           "memcpy_floor_s": floor, "stall_over_floor": stall / floor,
           "replica_gib_s": statistics.median(replica_bw) / GiB if replica_bw else None}
    out["replica_over_gloo"] = out["replica_gib_s"] * GiB / gloo_bw if replica_bw else None
    out["floor_sum_s"] = nbytes / floor_sum_bw  # memcpy + xxh3 + tmpfs write + gloo exchange of these bytes
    out["background_over_floors"] = out["background_s"] / out["floor_sum_s"]  # wall time, beside training
    return out


FLOORS = ("memcpy_s", "xxh3_s", "tmpfs_write_s", "gloo_s")


def alone_summary(alone: dict) -> dict:
    """One snapshot on its own (floor_worker) against the floors of its bytes, measured by the same two
    processes right after it (medians; seconds). The background target compares CPU time with CPU
    time (the process's, all threads and the kernel: what a shared machine's load does not inflate);
    the wall times are beside it."""
    n, snaps = alone["bytes"], alone["snapshots"]
    med = {k: statistics.median(r[k] for r in snaps) for k in snaps[0] if k != "bytes"}
    floors = {k: statistics.median(alone[k]) for k in FLOORS}
    floors_cpu = {k: statistics.median(alone[k.replace("_s", "_cpu_s")]) for k in FLOORS}
    floor_sum, floor_cpu_sum = sum(floors.values()), sum(floors_cpu.values())
    # the stricter floor: a tmpfs write over pages the file holds (what the tier's spares give it)
    over = {k: statistics.median(alone[k]) if k in alone else None for k in ("tmpfs_overwrite_s",
                                                                            "tmpfs_overwrite_cpu_s")}
    strict_cpu = floor_cpu_sum - floors_cpu["tmpfs_write_s"] + (over["tmpfs_overwrite_cpu_s"] or 0)
    return {"bytes": n, "count": len(snaps), **med, "floors": floors, "floors_cpu": floors_cpu,
            "floor_sum_s": floor_sum, "floor_cpu_sum_s": floor_cpu_sum, "tmpfs_overwrite": over,
            "cpu_over_floors_with_overwrite": med["cpu_s"] / strict_cpu if over["tmpfs_overwrite_cpu_s"] else None,
            "stage_over_memcpy": med["stage_s"] / floors["memcpy_s"],
            "cpu_over_floors": med["cpu_s"] / floor_cpu_sum,
            "wall_over_floors": (med["stage_s"] + med["background_s"]) / floor_sum,
            "transfer_over_gloo": floors["gloo_s"] / med["transfer_s"] if med["transfer_s"] else None,
            "replica_over_gloo": floors["gloo_s"] / med["replica_s"]}


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--floor-worker":
        rank, port, model, reps, shm, out = sys.argv[2:8]
        floor_worker(int(rank), int(port), model, int(reps), Path(shm), Path(out))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_memory_tier")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm") / getpass.getuser() / "memtier-bench")
    p.add_argument("--data", type=Path, default=ROOT / "outputs" / "data" / "pydoc-byte")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=32, help="steps of each throughput run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    p.add_argument("--reps", type=int, default=5, help="snapshots on their own, and repetitions of each floor")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    p.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache before the restarts")
    p.add_argument("--restore-only", action="store_true",
                   help="only part 4 (the restarts), written to restore.json: to re-measure after a change")
    p.add_argument("--floors-only", action="store_true",
                   help="only part 3 (one snapshot on its own against the floors), written to floors.json")
    a = p.parse_args(argv)
    if a.steps < a.warmup + 2 * max(MEMORY_INTERVALS):
        p.error(f"--steps must be at least --warmup + {2 * max(MEMORY_INTERVALS)} (two snapshots at interval 10)")
    a.out, a.shm, a.data = a.out.resolve(), a.shm.resolve(), a.data.resolve()
    from model.config import ModelConfig
    from model.counting import count_params
    from rehearsal.runs import prepare_debug_data

    prepare_debug_data(a.data)
    for d in (a.out / "runs", a.out / "logs", a.out / "backup", a.shm):
        shutil.rmtree(d, ignore_errors=True)
    (a.out / "logs").mkdir(parents=True)
    (a.out / "runs").mkdir()
    bench = Bench(a)
    params = count_params(ModelConfig(dim=a.dim, n_layers=a.layers, n_heads=bench.n_heads, vocab_size=a.vocab)).total
    t_bench = time.time()
    print(f"model {params / 1e6:.1f} M params (dim {a.dim}, {a.layers} layers, vocab {a.vocab}) + AdamW, 2 ranks as 2 "
          f"nodes; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {a.steps} steps per throughput run, "
          f"first {a.warmup} left out; memory root {a.shm}; runs in {a.out}", flush=True)
    if a.floors_only:
        try:
            alone = floors_and_snapshot(a, bench.n_heads, a.out / "floors-raw.json")
        finally:
            shutil.rmtree(a.shm, ignore_errors=True)
        al = alone_summary(alone)
        (a.out / "floors.json").write_text(json.dumps({"raw": alone, "summary": al}, indent=1))
        print(json.dumps({k: v for k, v in al.items()}, indent=1))
        print(f"load {os.getloadavg()[0]:.1f}; result: {a.out / 'floors.json'}")
        return
    if a.restore_only:
        try:
            drop = (lambda: False) if a.keep_page_cache else drop_page_cache
            restore = {"crash_local": bench.crash(), **bench.restarts(drop)}
        finally:
            shutil.rmtree(a.shm, ignore_errors=True)
            shutil.rmtree(a.out / "backup", ignore_errors=True)
        (a.out / "restore.json").write_text(json.dumps(restore, indent=1))
        for name, r in restore.items():
            print(f"{name:14s} step {r['step']} {r['source']:7s} {sorted(r['sources'].values())} load_s "
                  f"{r['load_s']:.2f} " + " ".join(f"{k} {r[k]}" for k in ("verify_s", "read_s", "apply_s", "check_s",
                                                                           "probe_s") if r.get(k) is not None))
        print(f"result: {a.out / 'restore.json'}")
        return
    try:
        print("1. throughput", flush=True)
        tp: Dict[str, dict] = {}
        memcpy, copy_bws = None, []
        plan = [("none", 0, 0), ("durable10", DURABLE_INTERVAL, 0)] + [(f"memory{k}", 0, k) for k in MEMORY_INTERVALS]
        for name, durable, memory in plan + [("none_again", 0, 0)]:
            tp[name] = bench.throughput(name, durable, memory)
            if memory:  # the memcpy floor right after each memory run, on the now idle machine
                memcpy = memcpy or Memcpy(tp[name]["snapshots"][0]["bytes"])
                copy_bws.append(memcpy.bandwidth())
        del memcpy
        print("3. floors and one snapshot on its own", flush=True)
        alone = floors_and_snapshot(a, bench.n_heads, a.out / "floors.json")
        print("4. restore", flush=True)
        drop = (lambda: False) if a.keep_page_cache else drop_page_cache
        restore = {"crash_local": bench.crash(), **bench.restarts(drop)}
    finally:
        shutil.rmtree(a.shm, ignore_errors=True)
        shutil.rmtree(a.out / "backup", ignore_errors=True)

    config = {"dim": a.dim, "layers": a.layers, "vocab": a.vocab, "params": params, "ranks": 2, "steps": a.steps,
              "warmup": a.warmup, "reps": a.reps, "durable_interval": DURABLE_INTERVAL,
              "memory_intervals": list(MEMORY_INTERVALS),
              "memory_runs_durable": "off", "restore_memory_interval": RESTORE_MEMORY_INTERVAL,
              "restore_snapshot": RESTORE_SNAPSHOT, "crash_step": CRASH_STEP, "cpus": os.cpu_count(),
              "load_after": os.getloadavg()[0], "elapsed_s": time.time() - t_bench}
    result = summarize(config, tp, copy_bws, alone, restore)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"result: {a.out / 'result.json'}")


EXPECTED_SOURCES = {"crash_local": ("memory", ["local", "local"]), "local_restart": ("memory", ["local", "local"]),
                    "peer": ("memory", ["local", "peer"]), "durable_cold": ("storage", ["storage", "storage"])}


def summarize(config: dict, tp: Dict[str, dict], copy_bws: List[float], alone: dict,
              restore: Dict[str, dict]) -> dict:
    """result.json from the measurements (memcpy bandwidths in bytes/s, floor_worker's record, the
    throughput runs, the restore records)."""
    memcpy_bw = statistics.median(copy_bws)
    a = alone_summary(alone)
    gloo_bw, floor_sum_bw = a["bytes"] / a["floors"]["gloo_s"], a["bytes"] / a["floor_sum_s"]
    base = statistics.fmean([tp["none"]["wall_per_step_s"], tp["none_again"]["wall_per_step_s"]])
    noise = abs(tp["none"]["wall_per_step_s"] - tp["none_again"]["wall_per_step_s"]) / base
    snapshots, problems = {}, []
    for r in tp.values():
        r["overhead"] = r["wall_per_step_s"] / base - 1
        if r["memory_interval"]:
            s = snapshots[str(r["memory_interval"])] = snapshot_summary(r["snapshots"], memcpy_bw, gloo_bw,
                                                                        floor_sum_bw)
            # what the stalls alone cost per step: the same number without the run-to-run noise
            r["stall_estimate"] = s["stall_s"] / r["memory_interval"] / base
            if s["committed"] != s["count"]:
                problems.append(f"memory interval {r['memory_interval']}: {s['count'] - s['committed']} of "
                                f"{s['count']} snapshots not committed")
    for name, r in restore.items():
        source, ranks = EXPECTED_SOURCES[name]
        step = config["restore_snapshot"] if source == "memory" else config["durable_interval"]
        got = (r["source"], sorted(r["sources"].values()), r["step"])
        r["as_expected"] = got == (source, ranks, step)
        if not r["as_expected"]:
            problems.append(f"{name}: resumed step {r['step']} from {r['source']} {r['sources']}, expected step "
                            f"{step} from {source} {ranks}")
    local, cold = restore["local_restart"], restore["durable_cold"]
    cold_probe = cold.get("probe_s") or 0.0
    s10 = snapshots["10"]
    targets = {
        "interval10_within_3pct": {"overhead": tp["memory10"]["overhead"], "target": 0.03, "noise": noise,
                                   "met": tp["memory10"]["overhead"] <= 0.03},
        "local_2x_faster_than_cold_durable": {"local_load_s": local["load_s"], "durable_load_s": cold["load_s"],
                                              "speedup": cold["load_s"] / local["load_s"], "target": 2.0,
                                              "met": cold["load_s"] >= 2 * local["load_s"],
                                              "durable_probe_s": cold.get("probe_s"),
                                              "speedup_without_durable_probe": (cold["load_s"] - cold_probe)
                                              / local["load_s"],
                                              "check": "memory: every applied tensor compared with the snapshot's "
                                                       "bytes (no probe); durable: the probe's forward"},
        # the training run's numbers decide; the same ratio for the snapshot on its own is beside it
        "replica_half_of_gloo": {"training": s10["replica_over_gloo"], "alone": a["replica_over_gloo"],
                                 "alone_transfer_only": a["transfer_over_gloo"], "target": 0.5,
                                 "met": (s10["replica_over_gloo"] or 0) >= 0.5,
                                 "alone_met": a["replica_over_gloo"] >= 0.5},
        "stall_1_5x_memcpy": {"training": s10["stall_over_floor"], "alone": a["stage_over_memcpy"],
                              "target": 1.5, "met": s10["stall_over_floor"] <= 1.5,
                              "alone_met": a["stage_over_memcpy"] <= 1.5},
        "background_2x_floors": {"alone_cpu": a["cpu_over_floors"], "alone_wall": a["wall_over_floors"],
                                 "training_wall": s10["background_over_floors"], "target": 2.0,
                                 "met": a["cpu_over_floors"] <= 2.0},
    }
    nbytes = tp["memory1"]["snapshots"][0]["bytes"]
    return {"config": config, "state_bytes_per_rank": nbytes,
            "floors": {"memcpy_gib_s": [b / GiB for b in copy_bws], "memcpy_median_gib_s": memcpy_bw / GiB,
                       "gloo_gib_s": [a["bytes"] / t / GiB for t in alone["gloo_s"]],
                       "gloo_median_gib_s": gloo_bw / GiB, "xxh3_gib_s": a["bytes"] / a["floors"]["xxh3_s"] / GiB,
                       "tmpfs_write_gib_s": a["bytes"] / a["floors"]["tmpfs_write_s"] / GiB,
                       "floor_bytes": a["bytes"]},
            "throughput": {"noise": noise, "none_mean_wall_s": base, "runs": tp},
            "snapshots": snapshots, "alone": a, "restore": restore, "targets": targets, "problems": problems}


def print_table(res: dict) -> None:
    tp, c = res["throughput"], res["config"]
    print(f"\n{c['params'] / 1e6:.1f} M params, {res['state_bytes_per_rank'] / GiB:.2f} GiB of state per rank, "
          f"2 ranks as 2 nodes, {c['cpus']} cores; {c['steps']} steps per run, first {c['warmup']} left out; "
          f"memory runs with the durable tier off")
    print(f"{'1. throughput':<13} | {'s/step':>7} | {'vs none':>7} | {'stalls/step':>11} | {'med step_s':>10} | "
          f"{'med wall':>8} | {'max wall':>8} | snapshots/saves")
    for name, r in tp["runs"].items():
        est = f"{100 * r['stall_estimate']:>10.1f}%" if "stall_estimate" in r else f"{'':>11}"
        print(f"{name:<13} | {r['wall_per_step_s']:>7.3f} | {100 * r['overhead']:>+6.1f}% | {est} | "
              f"{r['median_step_s']:>10.3f} | {r['median_wall_s']:>8.3f} | {r['max_wall_s']:>8.3f} | "
              f"{len(r['snapshots'])}/{r['durable_saves']}")
    print(f"run-to-run noise: none vs none_again {100 * tp['noise']:.1f}% (s/step: mean wall time per step; vs none: "
          f"against their mean; stalls/step: median stall / interval / none's s/step)")
    f = res["floors"]
    print(f"\n2./3. snapshots | {'stall s':>7} | {'waited':>6} | {'copy s':>6} | {'1st stall':>9} | "
          f"{'memcpy floor':>12} | {'stall/floor':>11} | {'backgr. s':>9} | {'replica s':>9} | "
          f"{'replica GiB/s':>13} | {'/ gloo':>6} | committed")
    for k, s in res["snapshots"].items():
        rep = (f"{s['replica_gib_s']:>13.2f} | {s['replica_over_gloo']:>6.2f}" if s["replica_gib_s"] is not None
               else f"{'-':>13} | {'-':>6}")
        print(f"interval {k:<6} | {s['stall_s']:>7.3f} | {s['waited_s']:>6.3f} | {s['copy_s']:>6.3f} | "
              f"{s['first_stall_s']:>9.3f} | {s['memcpy_floor_s']:>12.3f} | {s['stall_over_floor']:>11.2f} | "
              f"{s['background_s']:>9.3f} | {s['replica_s']:>9.3f} | {rep} | {s['committed']}/{s['count']}")
    print(f"floors, same bytes, same run: memcpy {f['memcpy_median_gib_s']:.2f} GiB/s (median of "
          f"{len(f['memcpy_gib_s'])}, one after each memory run); xxh3 {f['xxh3_gib_s']:.2f} GiB/s; tmpfs write "
          f"{f['tmpfs_write_gib_s']:.2f} GiB/s; gloo point-to-point both ways {f['gloo_median_gib_s']:.2f} GiB/s per "
          f"direction ({f['floor_bytes'] / GiB:.2f} GiB, median of {len(f['gloo_gib_s'])}); floor sum: "
          f"{res['snapshots']['10']['floor_sum_s']:.3f} s for interval 10's bytes")
    al, fl = res["alone"], res["alone"]["floors"]
    print(f"\n3. one snapshot on its own (the tier's code, two processes, nothing else running; median of "
          f"{al['count']}, {al['bytes'] / GiB:.2f} GiB):")
    print(f"   stage {al['stage_s']:.3f} s vs memcpy {fl['memcpy_s']:.3f} s = {al['stage_over_memcpy']:.2f}x | "
          f"background {al['background_s']:.3f} s (replica {al['replica_s']:.3f} s, on the wire "
          f"{al['transfer_s']:.3f} s, its writes overlapped) | CPU of the whole snapshot {al['cpu_s']:.3f} s")
    fc = al["floors_cpu"]
    print(f"   floors (wall): memcpy {fl['memcpy_s']:.3f} + xxh3 {fl['xxh3_s']:.3f} + tmpfs write "
          f"{fl['tmpfs_write_s']:.3f} + gloo {fl['gloo_s']:.3f} = {al['floor_sum_s']:.3f} s; (CPU): "
          f"{fc['memcpy_s']:.3f} + {fc['xxh3_s']:.3f} + {fc['tmpfs_write_s']:.3f} + {fc['gloo_s']:.3f} = "
          f"{al['floor_cpu_sum_s']:.3f} s")
    if al["cpu_over_floors_with_overwrite"] is not None:
        ow = al["tmpfs_overwrite"]
        print(f"   a tmpfs write over the pages a file holds (the tier's spare files): "
              f"{ow['tmpfs_overwrite_s']:.3f} s wall, {ow['tmpfs_overwrite_cpu_s']:.3f} s CPU; "
              f"CPU / CPU floors with it in place of the new file's write "
              f"{al['cpu_over_floors_with_overwrite']:.2f}x")
    print(f"   CPU / CPU floors {al['cpu_over_floors']:.2f}x, "
          f"wall / floors {al['wall_over_floors']:.2f}x; replica {al['replica_over_gloo']:.2f}x of gloo "
          f"(on the wire {al['transfer_over_gloo'] or 0:.2f}x)")
    print(f"\n{'4. restore':<14} | {'step':>4} | {'source':<7} | {'ranks':<15} | {'load_s':>6} | {'verify':>6} | "
          f"{'read':>6} | {'apply':>6} | {'check':>6} | {'probe':>6} | {'took':>6} | {'to resume':>9} | "
          f"{'to 1st step':>11}")

    def num(x) -> str:
        return f"{x:>6.2f}" if x is not None else f"{'-':>6}"

    for name, r in res["restore"].items():
        ranks = ",".join(r["sources"][k] for k in sorted(r["sources"]))
        print(f"{name:<14} | {r['step']:>4} | {r['source']:<7} | {ranks:<15} | {num(r['load_s'])} | "
              f"{num(r['verify_s'])} | {num(r['read_s'])} | {num(r['apply_s'])} | {num(r.get('check_s'))} | "
              f"{num(r.get('probe_s'))} | {num(r['resume_took_s'])} | "
              f"{r['to_resume_event_s']:>9.2f} | {r['to_first_step_s']:>11.2f}")
    cache = ("page cache dropped, imports re-warmed" if res["restore"]["durable_cold"]["page_cache_dropped"]
             else "page cache NOT dropped: the durable load is warm")
    print(f"crash_local: timed from the SIGKILL of rank 1 (torchrun restarts both workers); the others from the "
          f"restart of both agents ({cache}). took: the log's 'resume took' (load + verification); check: the "
          f"memory restore's byte comparison; probe: the durable verification's forward")
    t = res["targets"]

    a, b = t["interval10_within_3pct"], t["local_2x_faster_than_cold_durable"]
    r, st, bg = t["replica_half_of_gloo"], t["stall_1_5x_memcpy"], t["background_2x_floors"]
    print(f"\ntarget: memory interval 10 within 3% of no checkpointing: s/step against none's "
          f"{against(1 + a['overhead'], 1.03)} (noise, none vs none: {100 * a['noise']:.1f}%)")
    print(f"target: replica against the gloo floor: training (interval 10) {against(r['training'] or 0, 0.5, False)}; "
          f"on its own {against(r['alone'], 0.5, False)} (on the wire {r['alone_transfer_only'] or 0:.2f}x)")
    print(f"target: stall against the memcpy floor: training (interval 10) {against(st['training'], 1.5)}; the copy "
          f"on its own {against(st['alone'], 1.5)}")
    print(f"target: background CPU of one snapshot against the floor sum: {against(bg['alone_cpu'], 2.0)} (wall on "
          f"its own {bg['alone_wall']:.2f}x; wall beside training, interval 10, {bg['training_wall']:.2f}x)")
    print(f"target: a cold durable load against a local memory restore: {b['durable_load_s']:.2f} s against "
          f"{b['local_load_s']:.2f} s = {against(b['speedup'], 2.0, False)} (post-load check: {b['check']}; without "
          f"the durable probe's {b['durable_probe_s'] or 0:.2f} s: {b['speedup_without_durable_probe']:.2f}x)")
    for problem in res["problems"]:
        print(f"PROBLEM: {problem}")


if __name__ == "__main__":
    main()
