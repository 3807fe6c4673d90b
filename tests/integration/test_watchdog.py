"""The watchdog fires on a missed heartbeat within timeout + 2 s, writes its diagnostics,
aborts the process, and stays quiet through a legitimately long phase."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from recovery.runtime import StragglerMonitor, find_stragglers
from recovery.watchdog import Watchdog, read_records
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run, run_train, torchrun, worker

SLACK_S = 2.0  # the acceptance bound: detection within the configured timeout + 2 s


def _wait_for(pred, limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_missed_heartbeat_fires_with_stacks_and_record(tmp_path):
    fired = []
    wd = Watchdog(tmp_path, rank=3, timeouts={"step": 0.5}, hard_margin_s=0, on_expire=fired.append).start()
    try:
        wd.beat("step", 7)
        beat_at = time.monotonic()
        assert _wait_for(lambda: fired, 0.5 + SLACK_S + 1)
        latency = time.monotonic() - beat_at
    finally:
        wd.stop()
    expiry = fired[0]
    assert (expiry.kind, expiry.phase, expiry.step, expiry.rank) == ("heartbeat", "step", 7, 3)
    assert 0.5 < expiry.seconds_since_beat <= 0.5 + SLACK_S and latency <= 0.5 + SLACK_S
    record = read_records(tmp_path)[0]
    assert {"rank", "host", "pid", "phase", "step", "seconds_since_beat", "timeout_s"} <= set(record)
    stacks = next((tmp_path / "watchdog").glob("*-stacks.txt")).read_text()
    assert "test_missed_heartbeat_fires_with_stacks_and_record" in stacks  # the main thread's frame
    assert 'Thread' in stacks and "watchdog.py" in stacks  # every thread, the watchdog's own too


def test_no_false_alarm_during_long_checkpoint_load(tmp_path):
    fired = []
    wd = Watchdog(tmp_path, timeouts={"step": 0.3, "checkpoint_load": 5.0}, hard_margin_s=0,
                  on_expire=fired.append).start()
    try:
        wd.beat("checkpoint_load", 10)
        time.sleep(1.5)  # five step timeouts, well inside the load's own timeout
        assert not fired
        wd.beat("step", 11)
        assert _wait_for(lambda: fired, 0.3 + SLACK_S)
        assert fired[0].phase == "step"
    finally:
        wd.stop()


def test_stuck_background_write_fires_while_the_loop_beats(tmp_path):
    fired = []
    wd = Watchdog(tmp_path, timeouts={"step": 5.0}, write_timeout_s=0.6, hard_margin_s=0,
                  on_expire=fired.append).start()
    try:
        wd.write_started(20)
        for step in range(21, 60):  # training carries on and keeps beating
            wd.beat("step", step)
            if fired:
                break
            time.sleep(0.05)
        assert fired and fired[0].kind == "checkpoint_write" and fired[0].step == 20
        assert fired[0].extra["training_phase"] == "step"
    finally:
        wd.stop()


def test_finished_background_write_is_forgotten(tmp_path):
    fired = []
    wd = Watchdog(tmp_path, timeouts={"step": 5.0}, write_timeout_s=0.3, hard_margin_s=0,
                  on_expire=fired.append).start()
    try:
        wd.write_started(5)
        wd.write_done()
        time.sleep(0.9)
        assert not fired
    finally:
        wd.stop()


def _run_hang(tmp_path, how: str, hard_margin_s: float):
    proc = run([sys.executable, worker("watchdog_hang"), str(tmp_path), how, str(hard_margin_s)], timeout=60)
    return proc, float(proc.stdout.split()[0])


def test_hung_process_aborts_with_diagnostics_within_bound(tmp_path):
    proc, beat_wall = _run_hang(tmp_path, "sleep", 30.0)
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    record = read_records(tmp_path)[0]
    assert record["phase"] == "step" and record["step"] == 4
    assert record["detected_at"] - beat_wall <= 1.0 + SLACK_S
    assert "aborting so the launcher restarts" in proc.stderr
    # no core dump though the job allows them: at scale one is a process's whole mapping (GPU memory
    # included), written for minutes to a shared disk while the launcher waits
    assert sorted(p.name for p in tmp_path.iterdir()) == ["watchdog"]


def test_gil_holding_hang_is_caught_by_the_c_guard(tmp_path):
    start = time.monotonic()
    proc, _ = _run_hang(tmp_path, "gil", 1.0)
    assert proc.returncode == 1  # faulthandler's exit
    assert time.monotonic() - start < 30
    assert "Timeout (0:00:02)!" in proc.stderr and "watchdog_hang.py" in proc.stderr  # stacks dumped from C


def test_straggler_is_named():
    assert find_stragglers([1.0, 1.05, 0.98, 2.4], factor=1.5) == [3]
    assert find_stragglers([1.0, 1.2, 1.1, 1.3], factor=1.5) == []
    mon = StragglerMonitor(interval=3, factor=1.5)
    assert mon.record(1, 0.1) == [] and mon.record(2, 0.1) == [] and mon.last_report is None
    # one rank: the mean, never its own straggler
    assert mon.record(3, 0.4) == [] and mon.last_report == [pytest.approx(0.2)]


@pytest.mark.distributed
def test_straggler_report_over_ranks_names_slow_rank():
    """Three real gloo ranks; rank 1 reports 3x the step time of the others."""
    proc = run(torchrun(3, worker("straggler_ranks")), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "straggler: rank 1 took 0.300 s per step" in proc.stderr + proc.stdout
    reports = [line for line in proc.stdout.splitlines() if line.startswith("REPORT")]
    assert len(reports) == 3 and all("[1]" in r for r in reports)


@pytest.mark.distributed
def test_a_slow_rank_in_a_real_run_is_named_as_the_straggler(tmp_path, pydoc_data):
    """A 2-rank train.py run where rank 1 is 0.3 s slower at every step (a ``slow`` fault in the step
    phase): the step's collectives make the loop's wall time equal on both ranks, so the report must
    time each rank's own work, and name rank 1 (never rank 0)."""
    slow = faults_override([{"kind": "slow", "phase": "step", "step": -1, "rank": 1, "delay_s": 0.3}])
    proc = run_train(tiny_overrides(tmp_path / "run", pydoc_data, 6, 0, extra=[slow, "recovery.straggler_interval=3"]),
                     nproc=2, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = [line for line in proc.stderr.splitlines() if "straggler: rank" in line]
    # every rank logs the report (the first one may miss it: the first step's data loading is slow anywhere)
    assert {f"[rank{r}]" for r in (0, 1)} <= {line.split()[1] for line in named}, named
    assert all("straggler: rank 1 took" in line for line in named), named


def test_a_finished_write_is_seen_even_when_the_loop_is_stuck(tmp_path):
    """The loop hangs right after a save, so nobody calls write_done: the write's own
    done() tells the watchdog; the alarm is the heartbeat's, not a false write alarm."""
    fired = []
    wd = Watchdog(tmp_path, timeouts={"step": 1.0}, write_timeout_s=0.3, hard_margin_s=0,
                  on_expire=fired.append).start()
    try:
        wd.beat("step", 6)
        wd.write_started(6, is_done=lambda: True)
        assert _wait_for(lambda: fired, 1.0 + SLACK_S)
        assert fired[0].kind == "heartbeat"
    finally:
        wd.stop()
