"""No orphans: workers die with their torchrun agent, a worker cannot wait long for a store that
is gone, and a writer left over from an older attempt never commits over a newer attempt."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import pytest
import torch

from checkpoint.durable.discovery import checkpoint_dir, list_committed, read_latest_pointer
from checkpoint.durable.lease import StaleWriter, current_attempt, take_lease
from checkpoint.durable.manifest import Manifest, read_manifest
from checkpoint.durable.saver import CheckpointSaver
from metrics.records import read_metrics
from rehearsal.chains import faults_override
from rehearsal.processes import free_port
from rehearsal.runs import tiny_overrides
from support.processes import alive, children, start, stop, wait_for_faults

STALL = 31  # after the synchronous save of step 30 committed


def _committed(run_dir) -> list:
    return sorted(c.step for c in list_committed(run_dir / "checkpoints"))


@pytest.mark.distributed
def test_sigkill_of_the_agent_takes_its_workers_and_nothing_commits_after(tmp_path, pydoc_data):
    """Stock torchrun, 2 ranks, synchronous saves every 2 steps (the default mode). Both ranks stall
    4 s at step 31; the agent alone is SIGKILLed in the stall. Orphans would wake up and go on
    training and committing (step_32, ...), as they did before PR_SET_PDEATHSIG."""
    run_dir = tmp_path / "job"
    stall = faults_override([{"kind": "hang", "phase": "step", "step": STALL, "rank": -1, "hang_s": 4.0}])
    overrides = tiny_overrides(run_dir, pydoc_data, 200, 2, async_mode="sync", extra=[stall])
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        agent = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "train.py", *overrides], log)
        workers = []
        try:
            wait_for_faults(run_dir, 2, agent, log_path)
            workers = children(agent.pid)
            assert len(workers) == 2, workers
            committed = _committed(run_dir)
            last_step = max(r["step"] for r in read_metrics(run_dir))
            os.kill(agent.pid, signal.SIGKILL)
            killed = time.monotonic()
            while any(alive(w) for w in workers) and time.monotonic() - killed < 10:
                time.sleep(0.05)
            gone_after = time.monotonic() - killed
            survivors = [w for w in workers if alive(w)]
            time.sleep(max(0.0, 8.0 - (time.monotonic() - killed)))  # well past the end of the stall
        finally:
            stop(agent)
            for w in workers:  # orphans, if the test failed
                if alive(w):
                    os.kill(w, signal.SIGKILL)
    assert not survivors, f"workers {survivors} outlived their agent by 10 s"
    assert gone_after < 10
    assert committed[-1] == STALL - 1
    # No commit after the kill. Retention may still finish removing an older step (its manifest gone,
    # its files not yet) in the moment before the kill: that is not a commit, so committed steps are compared.
    assert _committed(run_dir) == committed
    assert max(r["step"] for r in read_metrics(run_dir)) == last_step  # and no step
    assert "fault injection: hang at step 31" in log_path.read_text()
    print(f"agent SIGKILLed: both workers gone after {gone_after:.2f} s")  # the runbook's number


def test_connecting_to_a_vanished_store_fails_in_seconds(monkeypatch):
    """A worker whose agent died before it connected (the agent hosts the store) gets
    STORE_CONNECT_TIMEOUT_S, not parallel.collective_timeout_s (600 s): measured here at 6-8.4 s for a
    3 s timeout (TCPStore's retries with back-off overshoot it), so the bound is "seconds, not 600". The
    test gives it 1 s."""
    from parallel.init import STORE_CONNECT_TIMEOUT_S, _restart_store

    port = free_port()  # nothing listens there
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="could not connect to torchrun's store .* within 1 s"):
        _restart_store(1, 2, datetime.timedelta(seconds=600), connect_timeout_s=1)
    assert time.monotonic() - t0 < 30  # not the 600 s the process group would wait
    assert STORE_CONNECT_TIMEOUT_S <= 30


def test_die_with_launcher_sets_the_parent_death_signal_only_under_torchrun():
    import ctypes

    from parallel.init import die_with_launcher

    libc = ctypes.CDLL(None, use_errno=True)
    got = ctypes.c_int(-1)
    assert die_with_launcher({}) is False
    libc.prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    before = got.value
    try:
        assert die_with_launcher({"TORCHELASTIC_RUN_ID": "x"}) is True
        libc.prctl(2, ctypes.byref(got), 0, 0, 0)
        assert got.value == signal.SIGKILL
    finally:
        libc.prctl(1, before, 0, 0, 0)  # this pytest process keeps what it had


def _manifest(step: int, tag: str) -> Manifest:
    return Manifest(f"step_{step:08d}", step, 0, 0, 0.0, tag, {"seed": 1}, 1, {"dp_shard": 1}, 8, 1.0, 1.0,
                    None, {})


def _saver(root) -> CheckpointSaver:
    saver = CheckpointSaver(root, "sync", rank=0, world_size=1, checksum_algorithm="crc32")
    saver.attempt = take_lease(root)
    return saver


def test_a_stale_writer_cannot_commit_over_a_newer_attempt(tmp_path):
    """Attempt 1's writer is still alive (an orphan, a job the scheduler thinks dead) when attempt 2
    starts on the same checkpoint.dir, takes the lease and commits step 10. Attempt 1 then tries
    to commit step 10 (its own version) and step 12: both are refused, attempt 2's checkpoint,
    its `latest` and the directory stay as attempt 2 left them."""
    old = _saver(tmp_path)
    new = _saver(tmp_path)
    assert (old.attempt, new.attempt, current_attempt(tmp_path)) == (1, 2, 2)
    new.save({"w": torch.full((64,), 2.0)}, _manifest(10, "new"))
    [record] = new.finished()
    assert record.committed
    before = (tmp_path / "step_00000010" / "manifest.json").read_text()

    for step in (10, 12):
        with pytest.raises(StaleWriter, match="is owned by attempt 2 .* this process \\(attempt 1"):
            old.save({"w": torch.full((64,), 1.0)}, _manifest(step, "old"))
    assert [c.step for c in list_committed(tmp_path)] == [10]
    assert (tmp_path / "step_00000010" / "manifest.json").read_text() == before
    assert read_manifest(tmp_path / "step_00000010").config_hash == "new"
    assert read_latest_pointer(tmp_path) == "step_00000010"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000010", "step_00000010.r1", "step_00000012"]
    # the old writer's acknowledgement never happened; its leftovers are uncommitted, which
    # discovery ignores and the next attempt's resume removes
    assert not (checkpoint_dir(tmp_path, 12) / "acks").exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_writer_whose_files_a_newer_attempt_removed_stops_as_a_stale_writer(tmp_path, monkeypatch, mode):
    """Attempt 1 is writing step 12 when attempt 2 takes the directory over (checkpoint.take_over=true, or its
    heartbeat went silent) and removes step_12 (an uncommitted leftover to it) under it. The writer stops with
    the StaleWriter message, naming both attempts, and commits nothing."""
    from checkpoint.durable.discovery import remove_checkpoint
    from checkpoint.durable.raw import RawFileWriter

    old = CheckpointSaver(tmp_path, mode, rank=0, world_size=1, checksum_algorithm="crc32")
    old.attempt = take_lease(tmp_path)
    write = RawFileWriter.write_data

    def taken_over_meanwhile(self, plan, planner):
        take_lease(tmp_path, timeout_s=60, take_over=True)
        remove_checkpoint(checkpoint_dir(tmp_path, 12))
        return write(self, plan, planner)

    monkeypatch.setattr(RawFileWriter, "write_data", taken_over_meanwhile)
    try:
        with pytest.raises(StaleWriter, match="is owned by attempt 2 .* this process \\(attempt 1") as err:
            old.save({"w": torch.full((64,), 1.0)}, _manifest(12, "old"))
            old.wait()  # async: the failure comes with the save in flight
    finally:
        old.close()
    assert "attempt 1" in str(err.value) and current_attempt(tmp_path) == 2 and list_committed(tmp_path) == []


def test_the_coordinator_refuses_an_acknowledgement_of_another_attempt(tmp_path):
    from checkpoint.durable.manifest import CheckpointError
    from checkpoint.durable.saver import acknowledge, collect_acknowledgements

    d = checkpoint_dir(tmp_path, 4)
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    (d / "__1_0.distcp").write_bytes(b"y" * 100)
    acknowledge(d, 0, "crc32", attempt=3)
    acknowledge(d, 1, "crc32", attempt=2)  # a rank of the older attempt wrote into the same directory
    assert json.loads((d / "acks" / "rank_00001.json").read_text())["attempt"] == 2
    with pytest.raises(CheckpointError, match="rank 1 was written by attempt 2, this is attempt 3"):
        collect_acknowledgements(d, 2, timeout_s=1, attempt=3)
