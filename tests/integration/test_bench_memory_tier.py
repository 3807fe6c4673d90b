"""scripts/bench_memory_tier.py: its result.json has every field.

The test runs the whole script (its floors for real: the gloo floor starts two processes, so it is
marked distributed) with the training launches replaced by rows shaped like the ones train.py writes
(the memory_snapshot event's fields are SnapshotRecord's). The script itself, on a real run, is what
docs/checkpoint-format.md's memory-tier numbers come from.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from checkpoint.memory.tier import SnapshotRecord
from support.launch import load_script

TOP = {"config", "state_bytes_per_rank", "floors", "throughput", "snapshots", "alone", "restore", "targets",
       "problems"}
RUNS = {"none", "durable10", "memory1", "memory5", "memory10", "none_again"}
RUN_FIELDS = {"durable_interval", "memory_interval", "steps_measured", "wall_per_step_s", "median_wall_s",
              "max_wall_s", "median_step_s", "durable_saves", "snapshots", "durable_blocking_s", "overhead"}
SNAPSHOT_FIELDS = {"count", "committed", "bytes", "replica_bytes", "stall_s", "first_stall_s", "waited_s", "copy_s",
                   "background_s", "replica_s", "memcpy_floor_s", "stall_over_floor", "replica_gib_s",
                   "replica_over_gloo", "floor_sum_s", "background_over_floors"}
ALONE_FIELDS = {"bytes", "count", "stage_s", "stage_cpu_s", "background_s", "replica_s", "transfer_s", "cpu_s",
                "floors", "floors_cpu", "floor_sum_s", "floor_cpu_sum_s", "stage_over_memcpy", "cpu_over_floors",
                "wall_over_floors", "transfer_over_gloo", "replica_over_gloo", "tmpfs_overwrite",
                "cpu_over_floors_with_overwrite"}
TARGETS = {"interval10_within_3pct", "local_2x_faster_than_cold_durable", "replica_half_of_gloo",
           "stall_1_5x_memcpy", "background_2x_floors"}
RESTORE_FIELDS = {"step", "source", "sources", "load_s", "verify_s", "read_s", "apply_s", "check_s", "total_s",
                  "resume_took_s", "probe_s",
                  "to_resume_event_s", "to_first_step_s", "as_expected"}
FLOOR_FIELDS = {"memcpy_gib_s", "memcpy_median_gib_s", "gloo_gib_s", "gloo_median_gib_s", "xxh3_gib_s",
                "tmpfs_write_gib_s", "floor_bytes"}


def check_result(res: dict, steps: int) -> None:
    assert set(res) == TOP
    assert set(res["floors"]) == FLOOR_FIELDS and res["floors"]["gloo_median_gib_s"] > 0
    assert res["floors"]["memcpy_median_gib_s"] > 0
    assert set(res["throughput"]) == {"noise", "none_mean_wall_s", "runs"} and set(res["throughput"]["runs"]) == RUNS
    for name, run in res["throughput"]["runs"].items():
        assert RUN_FIELDS <= set(run), name
        assert ("stall_estimate" in run) == bool(run["memory_interval"])
        assert run["steps_measured"] == steps - res["config"]["warmup"]
    assert set(res["snapshots"]) == {"1", "5", "10"}
    for k, s in res["snapshots"].items():
        assert set(s) == SNAPSHOT_FIELDS, k
        assert s["committed"] == s["count"] > 0 and s["replica_bytes"] > 0 and s["replica_gib_s"] > 0
    assert set(res["restore"]) == {"crash_local", "local_restart", "peer", "durable_cold"}
    for name, r in res["restore"].items():
        assert RESTORE_FIELDS <= set(r), name
        assert r["as_expected"], (name, r)
        assert 0 < r["to_resume_event_s"] <= r["to_first_step_s"]
    assert res["restore"]["peer"]["sources"] in ({"0": "local", "1": "peer"}, {"0": "peer", "1": "local"})
    alone = res["alone"]
    assert set(alone) == ALONE_FIELDS and alone["count"] == res["config"]["reps"] and alone["bytes"] > 0
    assert set(alone["floors"]) == set(alone["floors_cpu"]) == {"memcpy_s", "xxh3_s", "tmpfs_write_s", "gloo_s"}
    assert all(v > 0 for v in alone["floors"].values()) and alone["cpu_s"] > 0 and alone["transfer_s"] > 0
    assert all(v > 0 for v in alone["tmpfs_overwrite"].values()) and alone["cpu_over_floors_with_overwrite"] > 0
    assert set(res["targets"]) == TARGETS
    restore = res["targets"]["local_2x_faster_than_cold_durable"]
    assert restore["durable_probe_s"] == res["restore"]["durable_cold"]["probe_s"] > 0
    assert res["restore"]["local_restart"]["probe_s"] is None and res["restore"]["local_restart"]["check_s"] > 0
    assert all(isinstance(t["met"], bool) for t in res["targets"].values())
    assert res["problems"] == []


def _launch_from_rows(bench_mod, self, tag: str, run_dir: Path, overrides, max_restarts=0, stop_when=None):
    """What a launch of train.py on the two agents would leave: its metrics rows, logs, fault marker, memory."""
    o = dict(x.split("=", 1) for x in overrides)
    steps, durable, memory = (int(o[k]) for k in ("training.steps", "checkpoint.interval",
                                                  "checkpoint.memory.interval"))
    shm = Path(o["checkpoint.memory.root"])
    run_dir.mkdir(parents=True, exist_ok=True)
    t0, rows = time.time(), []
    logs = [self.logs / f"{tag}-node{n}.log" for n in (0, 1)]
    for path in logs:
        path.write_text("")

    def snapshot(step: int) -> dict:
        record = SnapshotRecord(step, 0.02, 0.0, 0.3, 0.1, 1 << 20, 1 << 20, True)
        return {"step": step, "kind": "memory_snapshot", **dataclasses.asdict(record)}

    def train(first: int, last: int) -> None:
        for s in range(first, last + 1):
            rows.append((t0 + 0.1 * s, {"step": s, "loss": 2.0, "step_s": 0.09}))
            if memory and s % memory == 0:
                rows.append((t0 + 0.1 * s + 0.01, snapshot(s)))
                for node in (0, 1):
                    (shm / f"node-{node}" / f"step_{s:08d}").mkdir(parents=True, exist_ok=True)
            if durable and s % durable == 0:
                rows.append((t0 + 0.1 * s + 0.01, {"step": s, "kind": "checkpoint", "blocking_s": 0.05}))

    def resume(step: int, source: str, sources: dict) -> None:
        timings = {"verify_s": 0.1, "read_s": 0.2, "apply_s": 0.1, "check_s": 0.05, "total_s": 0.4} \
            if source == "memory" else {}
        rows.append((t0 + 3.0, {"step": step, "kind": "resume", "load_s": 0.5, "source": source, "sources": sources,
                                **timings}))
        verified = ("weights: every tensor equal to the snapshot's bytes (no probe)" if source == "memory" else
                    "probe loss 5.5 == (bitwise) stored (probe 0.20 s)")
        logs[0].write_text(f"12:00:00 [rank0] INFO post-load verification of step_{step:08d} passed: step {step}, "
                           f"LR 1.0e-03 = schedule, {verified}\n"
                           "12:00:00 [rank0] INFO resume took 0.61 s (load + verification)\n")
        rows.append((t0 + 3.5, {"step": step + 1, "loss": 2.0, "step_s": 0.09}))

    if tag.startswith("tp-"):
        train(1, steps)
    elif tag == "restore-crash":
        train(1, 18)
        (run_dir / "faults").mkdir()
        (run_dir / "faults" / "fired-0-sigkill-on-rank1").write_text(f"step 19 time {t0 + 2.0:.3f} pid 1\n")
        resume(15, "memory", {"0": "local", "1": "local"})
    elif tag == "restore-stopped":
        train(1, 16)
    else:  # a restart: what the memory root still holds decides
        held = [n for n in (0, 1) if (shm / f"node-{n}").exists()]
        if held:
            resume(15, "memory", {str(n): "local" if n in held else "peer" for n in (0, 1)})
        else:
            resume(10, "storage", {"0": "storage", "1": "storage"})
    if stop_when is not None:
        assert stop_when(rows), tag
    return bench_mod.Launch(tag, t0, [0, 0], rows, logs)


@pytest.mark.distributed
def test_the_result_has_every_field(tmp_path, monkeypatch, pydoc_data):
    bench = load_script("bench_memory_tier")
    monkeypatch.setattr(bench.Bench, "launch", lambda *a, **k: _launch_from_rows(bench, *a, **k))
    monkeypatch.setattr(bench, "WARM_IMPORTS", [sys.executable, "-c", "pass"])
    out, shm = tmp_path / "out", tmp_path / "shm"
    bench.main(["--out", str(out), "--shm", str(shm), "--data", str(pydoc_data), "--dim", "64",
                "--layers", "2", "--vocab", "320", "--steps", "22", "--reps", "2", "--keep-page-cache"])
    check_result(json.loads((out / "result.json").read_text()), 22)
    assert not shm.exists() and not (out / "backup").exists()
