"""A launch into a run directory whose owner is live is refused and changes nothing there; a dead
owner (killed, or silent for checkpoint.lease_timeout_s) is taken over, and the run resumes.

The lease's rules are checked in-process on real files (records written as the owner writes them,
their heartbeat's age set with os.utime); real launches show what a user sees."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from checkpoint.durable.discovery import checkpoint_dir, clean_uncommitted
from checkpoint.durable.lease import (
    ATTEMPTS,
    RELEASED,
    Heartbeat,
    LiveOwner,
    current_attempt,
    earlier_writers_may_live,
    live_owner,
    take_lease,
)
from metrics.records import read_metrics, read_rows, step_losses
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import ROOT, load_script, run_train
from support.processes import start, stop

ELSEWHERE = "node-elsewhere"  # an owner on another host: only its heartbeat tells whether it lives


def _record(root, attempt: int, host: str = ELSEWHERE, pid: int = 4242, age_s: float = 0.0, **extra):
    d = root / ATTEMPTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"attempt_{attempt:06d}"
    path.write_text(json.dumps({"pid": pid, "host": host, "started_at": time.time() - age_s, **extra}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_live_owner_is_named_with_the_choices(tmp_path):
    _record(tmp_path, 3, age_s=5)
    message = live_owner(tmp_path, timeout_s=60)
    assert f"attempt 3 (pid 4242 on {ELSEWHERE}, started " in message and "heartbeat 5 s ago" in message
    for choice in ("Wait for it to finish", "another run_name", "checkpoint.take_over=true", "Nothing was changed"):
        assert choice in message
    before = sorted(p.name for p in (tmp_path / ATTEMPTS).iterdir())
    with pytest.raises(LiveOwner):
        take_lease(tmp_path, timeout_s=60)
    assert sorted(p.name for p in (tmp_path / ATTEMPTS).iterdir()) == before  # the refusal wrote nothing
    assert take_lease(tmp_path, timeout_s=60, take_over=True) == 4  # explicitly taken over


@pytest.mark.parametrize("how", ["silent past the timeout", "released", "dead on this host", "a zombie on this host",
                                 "same torchrun job"])
def test_a_gone_owner_is_taken_over_at_once(tmp_path, monkeypatch, how):
    if how == "silent past the timeout":
        _record(tmp_path, 1, age_s=61)
    elif how == "released":
        (_record(tmp_path, 1).parent / f"attempt_000001{RELEASED}").touch()
    elif how == "dead on this host":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()  # reaped: its pid names no process now
        _record(tmp_path, 1, host=socket.gethostname(), pid=dead.pid)
    elif how == "a zombie on this host":  # killed, its parent gone before reaping it (a SIGKILLed agent's worker)
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        _record(tmp_path, 1, host=socket.gethostname(), pid=zombie.pid)
    else:  # torchrun restarted its workers: the old rank 0 may not have been reaped yet
        _record(tmp_path, 1, host=socket.gethostname(), pid=os.getpid(), run_id="job-7", restart_count="0")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert live_owner(tmp_path, timeout_s=60) is None
    assert take_lease(tmp_path, timeout_s=60) == 2
    # its start-up clean-up: a silent owner elsewhere may still write (its saves in flight are spared), the others not
    assert earlier_writers_may_live(tmp_path, 2) == (how == "silent past the timeout")
    if how == "a zombie on this host":
        zombie.wait()


def test_a_record_being_written_is_a_live_owner(tmp_path):
    """A launch at the same moment reads the record another has just created (O_EXCL) but not yet
    written: that owner is live (its age says so), not absent."""
    record = _record(tmp_path, 1)
    record.write_text("")
    assert "attempt 1" in live_owner(tmp_path, timeout_s=60)
    with pytest.raises(LiveOwner):
        take_lease(tmp_path, timeout_s=60)
    assert current_attempt(tmp_path) == 1


def test_the_heartbeat_keeps_the_lease_live_and_releases_it(tmp_path):
    attempt = take_lease(tmp_path, timeout_s=60)
    record = tmp_path / ATTEMPTS / f"attempt_{attempt:06d}"
    os.utime(record, (time.time() - 100, time.time() - 100))  # as if the last beat were long ago
    beat = Heartbeat(tmp_path, attempt, timeout_s=0.2)  # beats every 0.05 s
    while time.time() - record.stat().st_mtime > 50:  # until the thread has beaten once
        time.sleep(0.01)
    assert live_owner(tmp_path, timeout_s=60) is not None  # this process is alive on this host, and beats
    beat.stop()
    assert live_owner(tmp_path, timeout_s=60) is None and current_attempt(tmp_path) == attempt


def test_start_up_clean_up_spares_the_saves_a_taken_over_owner_may_still_write(tmp_path):
    """checkpoint.take_over=true from a live owner elsewhere: the new attempt's clean-up leaves that owner's
    uncommitted step written to within lease_timeout_s (it may be its save in flight) and removes an older
    leftover; once the old owner released its lease, the next start removes everything uncommitted."""
    record = _record(tmp_path, 1, age_s=5)
    attempt = take_lease(tmp_path, timeout_s=60, take_over=True)
    in_flight, leftover = checkpoint_dir(tmp_path, 20), checkpoint_dir(tmp_path, 10)
    for d in (in_flight, leftover):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 64)
    for p in (leftover / "__0_0.distcp", leftover):
        os.utime(p, (time.time() - 120, time.time() - 120))
    assert earlier_writers_may_live(tmp_path, attempt)
    assert clean_uncommitted(tmp_path, 60) == [leftover.name]
    assert (in_flight / "__0_0.distcp").read_bytes() == b"x" * 64
    record.with_name(record.name + RELEASED).touch()  # the old owner closed
    assert not earlier_writers_may_live(tmp_path, attempt)
    assert clean_uncommitted(tmp_path, None) == [in_flight.name] and not in_flight.exists()


def _slow(delay_s: float) -> str:
    return faults_override([{"kind": "slow", "phase": "step", "step": -1, "rank": 0, "delay_s": delay_s}])


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


@pytest.mark.distributed
def test_launches_into_a_live_run_are_refused_and_it_finishes_as_if_alone(tmp_path, pydoc_data):
    """Two launches of the same command started back to back (which checks the lease first, and whether
    the other holds it by then, is left to the moment and not checked): one takes it and runs, the other
    exits 2 naming it, before it builds or writes anything. Then one with another seed while the first
    runs: refused too. The run finishes with the losses of a lone run, bitwise, and its own config.yaml."""
    live, lone = tmp_path / "live", tmp_path / "lone"
    base = tiny_overrides(live, pydoc_data, 40, 10, async_mode="async")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with open(logs[0], "w") as a, open(logs[1], "w") as b:
        twins = [start([sys.executable, str(ROOT / "train.py"), *base, _slow(0.25)], log, warm=True) for log in (a, b)]
        try:
            deadline = time.monotonic() + 300
            while all(t.poll() is None for t in twins) and time.monotonic() < deadline:
                time.sleep(0.05)
            ended = [i for i, t in enumerate(twins) if t.poll() is not None]
            assert ended, ("neither launch ended in 300 s: one of them should have been refused (exit 2)\n"
                           + "\n".join(log.read_text()[-1500:] for log in logs))
            lost = ended[0]  # the first to end
            first = twins[1 - lost]
            other_seed = run_train([*base, "seed=7"], check=False)
            still_running = first.poll() is None
            assert first.wait(timeout=300) == 0, logs[1 - lost].read_text()[-3000:]
        finally:
            for t in twins:
                stop(t)
    assert still_running, "the first run ended before the second launch: the test proves nothing; slow it down"
    twin = logs[lost].read_text()
    assert twins[lost].returncode == 2, twin[-3000:]
    for refused in (twin, other_seed.stderr):
        assert "is in use by a live run: attempt 1 (pid" in refused and "Traceback" not in refused, refused[-3000:]
        assert "data source" not in refused and "this is attempt" not in refused  # nothing was built
    assert sorted(p.name for p in (live / "checkpoints" / ATTEMPTS).iterdir()) == [
        "attempt_000001", f"attempt_000001{RELEASED}"]  # no second attempt was ever taken
    assert "seed: 1234" in (live / "config.yaml").read_text()
    assert "StaleWriter" not in logs[1 - lost].read_text()
    run_train(tiny_overrides(lone, pydoc_data, 40, 10, async_mode="async"))
    assert _losses(live) == _losses(lone) and len(_losses(live)) == 40
    assert {r.get("attempt") for r in read_metrics(live)} == {1}  # every step row names its attempt


@pytest.mark.distributed
def test_a_killed_owner_is_taken_over_after_its_heartbeat_stops_and_the_run_resumes(tmp_path, pydoc_data):
    """SIGKILLed at step 13 (step 10 committed): on this host its dead pid frees the lease at once; as
    an owner on another host (its record edited so) it is refused while the heartbeat is younger than
    checkpoint.lease_timeout_s and taken over once it is older; the run resumes from step 10."""
    run_dir = tmp_path / "run"
    kill = faults_override([{"kind": "sigkill", "phase": "step", "step": 13}])
    base = [*tiny_overrides(run_dir, pydoc_data, 20, 5, async_mode="sync"), "checkpoint.lease_timeout_s=30"]
    killed = run_train([*base, kill], check=False)
    assert killed.returncode != 0
    record = run_dir / "checkpoints" / ATTEMPTS / "attempt_000001"
    owner = json.loads(record.read_text())
    record.write_text(json.dumps({**owner, "host": ELSEWHERE}))  # now only the heartbeat can tell
    refused = run_train(base, check=False)  # the record was just written: a heartbeat seconds old
    assert refused.returncode == 2 and f"on {ELSEWHERE}" in refused.stderr, refused.stderr[-3000:]
    assert current_attempt(run_dir / "checkpoints") == 1
    os.utime(record, (time.time() - 31, time.time() - 31))  # no beat for longer than lease_timeout_s
    resumed = run_train(base)
    assert current_attempt(run_dir / "checkpoints") == 2
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000010", resumed.stderr[-2000:]


def test_metrics_readers_keep_the_rows_of_the_attempt_that_owns_the_run(tmp_path):
    """Attempt 1 was taken over (checkpoint.take_over=true) while it still ran: its rows after attempt 2's
    first row are a stale writer's, and the readers leave them out; rows from before the lease stay."""
    rows = [{"step": 0, "kind": "banner"}, {"step": 1, "attempt": 1, "loss": 5.0},
            {"step": 2, "attempt": 1, "loss": 4.0}, {"step": 2, "attempt": 2, "loss": 4.5},
            {"step": 3, "attempt": 1, "loss": 3.0}, {"step": 3, "attempt": 2, "loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 5.0), (2, 4.0), (2, 4.5), (3, 3.5)]
    assert step_losses(tmp_path) == {1: 5.0, 2: 4.5, 3: 3.5}
    assert len(read_rows(tmp_path, stale=True)) == len(rows)


def test_torchruns_default_job_id_names_no_job(tmp_path, monkeypatch):
    """A multi-node static rendezvous without --rdzv-id gives every job TORCHELASTIC_RUN_ID=none:
    two unrelated launches with it are not one job, so the live owner is refused."""
    _record(tmp_path, 1, run_id="none")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(LiveOwner):
        take_lease(tmp_path, timeout_s=60)


def test_the_launchers_precheck_sees_the_jobs_id(monkeypatch):
    """scripts/torchrun_preemptible.py checks the config before torchrun starts (and sets
    TORCHELASTIC_RUN_ID for the workers): the check must see the job's --rdzv-id as the workers
    will, or a requeue of the job inside the lease timeout would be refused as a foreign owner."""
    script = load_script("torchrun_preemptible")
    seen = []
    monkeypatch.setattr(script.subprocess, "run",
                        lambda cmd, env: seen.append(env) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert script.check_config(["--nnodes=2", "--nproc-per-node=4", "--rdzv-id", "job-42", "train.py", "seed=1"]) == 0
    assert seen[-1]["TORCHELASTIC_RUN_ID"] == "job-42" and seen[-1]["WORLD_SIZE"] == "8"
    script.check_config(["--standalone", "--nproc-per-node=2", "train.py"])  # torchrun makes a fresh id
    assert "TORCHELASTIC_RUN_ID" not in seen[-1]
