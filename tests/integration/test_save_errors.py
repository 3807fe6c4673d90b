"""A checkpoint disk that fills up, turns read-only or runs out of quota during a save.

On a real tmpfs (checkpoint.dir only; the run dir stays elsewhere) mounted small for the test:
the disk is filled, or remounted read-only, while every rank stalls at step 15; the save of
step 20 fails. With checkpoint.on_save_error=stop (the default) the uncommitted directory is
removed, the run stops cleanly with one message naming the directory, the free bytes, the
checkpoint size and what to do, and an alarm lands in metrics.jsonl; the newest committed
checkpoint (step 10) is untouched. A relaunch on the still-full disk stops in pre-flight,
before step 1; once there is room it resumes from step 10, bitwise equal to an uninterrupted
run. With on_save_error=continue the run trains on and the next save, once there is room,
commits. A disk_full fault (ENOSPC on one rank only) shows the ranks agree.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.durable.discovery import checkpoint_dir
from checkpoint.durable.manifest import Manifest
from checkpoint.durable.preflight import PreflightError, preflight_checkpoint_dir, room_for
from checkpoint.durable.saver import CheckpointSaveError, CheckpointSaver
from checkpoint.storage import location
from metrics.records import read_metrics, step_losses
from rehearsal.chains import divergences, faults_override
from rehearsal.runs import tiny_overrides
from support.launch import run_train
from support.processes import start, stop, wait_for_faults
from support.tmpfs import tmpfs

STEPS, INTERVAL, STALL = 30, 10, 15
TMPFS_MIB = 24  # pre-flight of a fresh run: 3 x 5,414,400 bytes (the debug model's estimate) x 1.05 fit


def fill(disk: Path, leave: int = 1 << 20) -> Path:
    """Fill ``disk`` but ``leave`` bytes with one file; returns the file."""
    filler = disk / "filler"
    size = shutil.disk_usage(disk).free - leave
    with open(filler, "wb") as f:
        chunk = b"\0" * (1 << 20)
        while size > 0:
            size -= f.write(chunk[:min(size, len(chunk))])
    return filler


def overrides(run_dir: Path, data: Path, disk: Path, mode: str, stalls=(STALL,), extra=()):
    faults = [{"kind": "hang", "phase": "step", "step": s, "rank": -1, "hang_s": 3.0} for s in stalls]
    return tiny_overrides(run_dir, data, STEPS, INTERVAL, async_mode=mode, extra=[
        faults_override(faults), f"checkpoint.dir={disk}", *extra])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pydoc_data):
    run_dir = tmp_path_factory.mktemp("save-errors") / "baseline"
    run_train(tiny_overrides(run_dir, pydoc_data, STEPS, 0))
    return step_losses(run_dir)


def _run_until_stall(cmd, run_dir: Path, ranks: int, log_path: Path, break_disk, stalls: int = 1):
    """Start ``cmd``, call ``break_disk()`` while every rank stalls at step 15, wait for the end."""
    with open(log_path, "w") as log:
        job = start(cmd, log, warm=True)
        try:
            wait_for_faults(run_dir, ranks, job, log_path)
            result = break_disk()
            if stalls > 1:
                wait_for_faults(run_dir, ranks * stalls, job, log_path)
                result = result()
            code = job.wait(timeout=600)
        finally:
            stop(job)
    return code, log_path.read_text()


def _committed(disk: Path):
    return sorted(p.name for p in disk.glob("step_*") if (p / "manifest.json").is_file())


@pytest.mark.distributed
@pytest.mark.parametrize("mode, how", [("sync", "full"), ("async", "full"), ("sync", "read_only")])
def test_a_failed_save_stops_cleanly_preflight_refuses_the_relaunch_and_nothing_is_lost(
        tmp_path, pydoc_data, baseline, mode, how):
    run_dir = tmp_path / "run"
    with tmpfs(tmp_path / "disk", TMPFS_MIB) as disk:
        args = overrides(run_dir, pydoc_data, disk, mode)
        if how == "full":
            def break_disk():
                return fill(disk)
        else:
            def break_disk():
                subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        code, log = _run_until_stall([sys.executable, "train.py", *args], run_dir, 1, tmp_path / "first.log",
                                     break_disk)
        assert code == 1, log[-6000:]
        assert "Traceback" not in log
        block = log[log.index("\nerror: CheckpointSaveError: "):]
        reason = "the disk is full (ENOSPC)" if how == "full" else "the file system is read-only (EROFS)"
        assert f"checkpoint of step 20 could not be saved: {reason}" in block
        assert f"directory: {checkpoint_dir(disk, 20)} (removed;" in block
        assert "the newest committed checkpoint, step_00000010, is intact" in block
        free = shutil.disk_usage(disk).free
        assert f"free in {disk}: {free:,} bytes" in block, block
        size = json.loads((checkpoint_dir(disk, 10) / "manifest.json").read_text())
        size = sum(f["size"] for f in size["files"].values())
        assert f"one checkpoint of this run: {size:,} bytes" in block  # the committed one's, from its manifest
        assert "what to do: " in block and "checkpoint.keep_last" in block
        assert _committed(disk) == ["step_00000010"] and not checkpoint_dir(disk, 20).exists()
        [alarm] = read_metrics(run_dir, "alarm")
        assert (alarm["check"], alarm["action"], alarm["step"]) == ("checkpoint_save", "stop", 20)
        assert alarm["errno"] == (errno.ENOSPC if how == "full" else errno.EROFS)
        last = max(r["step"] for r in read_metrics(run_dir))
        # async: the write fails in the background; the ranks stop at the first step whose flags carry it,
        # before the next save (step 30) could start (how many steps that is depends on the machine's load)
        assert last == 20 if mode == "sync" else 20 <= last < 30, last

        # relaunch on the same disk: stops in pre-flight, before step 1 (read-only: in the checks, before the build)
        rows = len(read_metrics(run_dir))
        again = run_train(args, check=False)
        assert again.returncode == (1 if how == "full" else 2) and "Traceback" not in again.stderr
        if how == "full":
            assert "error: PreflightError: checkpoint.dir=" in again.stderr
            assert "but this run needs" in again.stderr and f"of {size:,} bytes" in again.stderr
        else:
            assert f"error: ConfigError: invalid configuration:\n  - checkpoint.dir={disk}: the folder is on a " \
                   "read-only file system" in again.stderr, again.stderr[-2000:]
        assert len(read_metrics(run_dir)) == rows and "step 11/30" not in again.stderr

        if how == "full":  # room for one more checkpoint, not for keep_last + 1 = 3 with step_10 there: stop too
            (disk / "filler").unlink()
            fill(disk, leave=int(1.5 * size))
            again = run_train(args, check=False)
            assert again.returncode == 1 and "2 more checkpoint(s) of" in again.stderr, again.stderr[-3000:]
            assert len(read_metrics(run_dir)) == rows
            (disk / "filler").unlink()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        run_train(args)  # room again: resumes from step 10 and finishes
        assert [e["checkpoint_id"] for e in read_metrics(run_dir, "resume")] == ["step_00000010"]
        assert divergences(baseline, run_dir) == []
        assert _committed(disk) == ["step_00000020", "step_00000030"]


@pytest.mark.distributed
def test_on_save_error_continue_trains_on_and_the_next_save_commits(tmp_path, pydoc_data, baseline):
    run_dir = tmp_path / "run"
    with tmpfs(tmp_path / "disk", TMPFS_MIB) as disk:
        args = overrides(run_dir, pydoc_data, disk, "async", stalls=(STALL, 25),
                         extra=["checkpoint.on_save_error=continue"])

        def break_disk():  # at step 15: full; at step 25 (after the failed save of 20): room again
            filler = fill(disk)
            return lambda: filler.unlink()

        code, log = _run_until_stall([sys.executable, "train.py", *args], run_dir, 1, tmp_path / "log",
                                     break_disk, stalls=2)
        assert code == 0, log[-6000:]
        [alarm] = read_metrics(run_dir, "alarm")
        assert (alarm["check"], alarm["action"], alarm["step"], alarm["errno"]) == (
            "checkpoint_save", "continue", 20, errno.ENOSPC)
        assert "checkpoint.on_save_error=continue, training goes on: checkpoint of step 20 could not be saved" in log
        assert divergences(baseline, run_dir) == []  # training itself never noticed
        assert _committed(disk) == ["step_00000010", "step_00000030"]  # the newest committed one was kept
        assert [r["step"] for r in read_metrics(run_dir, "checkpoint")] == [10, 30]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_failing_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, pydoc_data, mode):
    """Each rank learns of the failure when its own background save finishes, a few steps later under
    load; the flag is agreed at the end of a step, so every rank raises at the same one. The save of
    step 30 waits for the one of 20 first, so with async writes the run stops within 20..30 (never 40)."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, pydoc_data, 40, INTERVAL, async_mode=mode, extra=[
        faults_override([{"kind": "disk_full", "phase": "checkpoint_write", "step": 20, "rank": 1}])])
    proc = run_train(args, nproc=2, check=False)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"error (rank {rank}): CheckpointSaveError: checkpoint of step 20 could not be saved: the disk is full"
                f" (ENOSPC). rank 1: [Errno 28] No space left on device (injected disk_full fault)") in proc.stderr
    last = {r["step"] for r in read_metrics(run_dir)}
    assert max(last) == 20 if mode == "sync" else 20 <= max(last) <= 30, sorted(last)[-3:]
    assert "watchdog" not in proc.stderr.lower()  # no rank was left waiting in a collective
    assert _committed(run_dir / "checkpoints") == ["step_00000010"]
    assert not checkpoint_dir(run_dir / "checkpoints", 20).exists()


def _manifest(step: int, files=None) -> Manifest:
    return Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "h", {"seed": 1}, 1, {"dp_shard": 1}, 8, 1.0, 1.0,
                    None, files or {})


@pytest.mark.parametrize("code, words", [
    (errno.ENOSPC, "the disk is full (ENOSPC)"),
    (errno.EDQUOT, "the disk quota is exhausted (EDQUOT)"),
    (errno.EROFS, "the file system is read-only (EROFS)"),
])
def test_a_storage_error_in_the_writer_is_reported_and_cleaned_up(tmp_path, code, words):
    """In-process, one rank: the saver's error path for each errno (the tmpfs tests above drive the
    full and read-only cases through the real disk; a quota cannot be set up here)."""
    def hook(phase, step, path=None):
        if phase == "checkpoint_write" and step == 4:
            raise OSError(code, os.strerror(code), str(path / "__0_0.distcp"))

    saver = CheckpointSaver(tmp_path, "sync", rank=0, world_size=1, checksum_algorithm="crc32", fault_hook=hook)
    saver.expected_bytes = 1234
    saver.save({"w": torch.ones(8)}, _manifest(2))
    with pytest.raises(CheckpointSaveError) as err:
        saver.save({"w": torch.ones(8)}, _manifest(4))
    text = str(err.value)
    assert err.value.errno == code and err.value.step == 4
    assert f"checkpoint of step 4 could not be saved: {words}" in text
    assert f"directory: {checkpoint_dir(tmp_path, 4)} (removed;" in text and "step_00000002, is intact" in text
    assert "one checkpoint of this run: 1,234 bytes" in text and f"free in {tmp_path}: " in text
    assert not checkpoint_dir(tmp_path, 4).exists() and checkpoint_dir(tmp_path, 2).is_dir()



@pytest.fixture
def other_writers(monkeypatch):
    """The temporary folders' file system as the suite shares it: the other pytest worker (and every other
    process on the machine) writes and deletes files there, so its free space moves between any two looks
    (two looks compared once failed the fast loop on a loaded machine). Modelled here: every look at the disk
    finds 4 KiB less free than the one before. A test compares what the pre-flight saw (``free_seen``)."""
    real, looks = shutil.disk_usage, []

    def disk_usage(path):
        usage = real(path)
        looks.append(path)
        return usage._replace(free=usage.free - 4096 * len(looks))
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return looks



def free_seen(monkeypatch, root) -> list:
    """(path, free bytes) of every look the pre-flight takes at the disk under ``root``, as it saw them."""
    store, seen = location(root).store, []
    real = store.free_bytes
    monkeypatch.setattr(store, "free_bytes", lambda key: seen.append((key, real(key))) or seen[-1][1])
    return seen

def test_preflight_counts_the_checkpoints_to_come(tmp_path, monkeypatch, other_writers):
    """keep_last + 1 checkpoints while a save is written, minus those already committed; the size
    from the newest manifest; leftovers of interrupted saves count as free."""
    from checkpoint.durable.manifest import FileEntry
    from checkpoint.durable.saver import commit_checkpoint

    root = tmp_path / "ckpt"
    room = room_for(root.parent, estimate_bytes=1000, keep_last=2)
    assert (room.checkpoint_bytes, room.to_write, room.needed) == (1000, 3, 3150)
    root.mkdir()
    for step in (10, 20):
        d = checkpoint_dir(root, step)
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 5000)
        commit_checkpoint(d, _manifest(step, {"__0_0.distcp": FileEntry(5000, None)}))
    leftover = checkpoint_dir(root, 30)
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"y" * 7000)
    seen = free_seen(monkeypatch, root)
    room = room_for(root, estimate_bytes=1000, keep_last=2)
    assert (room.checkpoint_bytes, room.committed, room.to_write) == (5000, 2, 1)
    assert "step_00000020's manifest" in room.source
    assert seen == [(str(root), room.free - 7000)]  # one look at the disk, plus the leftovers
    assert room_for(root, 1000, keep_last=5).to_write == 4
    too_many = shutil.disk_usage(root).total // 5000 + 10  # more than the whole disk, however full it is now
    with pytest.raises(PreflightError, match="needs .* more checkpoint\\(s\\) of 5,000 bytes \\(the size in"):
        preflight_checkpoint_dir(root, 1000, keep_last=too_many, rank=0)
    preflight_checkpoint_dir(root, 1000, keep_last=too_many, rank=0, strict=False)  # continue: a warning


def test_only_rank_0_lists_the_checkpoint_directory_for_the_preflight(tmp_path, monkeypatch, other_writers):
    """At 512 ranks, 512 listings and manifest reads of one directory at start-up: rank 0 lists it
    (held_once) and every other rank measures its free space against rank 0's answer."""
    from checkpoint.durable import preflight
    from parallel import collectives

    rank0 = preflight.Held(checkpoint_bytes=5000, source="rank 0's listing", committed=2, leftover=7000)
    sent = []
    monkeypatch.setattr(collectives, "distributed", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_rank", lambda group=None: 1)  # this process plays rank 1
    monkeypatch.setattr(collectives, "any_rank", lambda flag, group=None: flag)  # polled while rank 0 lists
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: sent.append(obj) or [rank0, None])

    def must_not_list(*args, **kwargs):
        raise AssertionError("rank 1 listed the checkpoint directory")
    monkeypatch.setattr(preflight, "Listing", must_not_list)
    held = preflight.held_once(tmp_path, estimate_bytes=1000)
    assert held == rank0 and sent == [[None, None]]  # rank 1 sent nothing of its own
    seen = free_seen(monkeypatch, tmp_path)
    room = preflight.room_for(tmp_path, 1000, keep_last=2, held=held)
    assert (room.checkpoint_bytes, room.committed, room.to_write) == (5000, 2, 1)
    assert seen == [(str(tmp_path), room.free - 7000)]  # its own look at its disk, plus rank 0's leftovers


@pytest.mark.parametrize("coordinator_saw_newer", [True, False])
def test_whether_a_newer_attempt_owns_the_directory_is_the_coordinators_answer(tmp_path, monkeypatch,
                                                                              coordinator_saw_newer):
    """A save phase failed on every rank (ENOSPC on rank 0): rank 1 does not read the lease itself
    but takes the coordinator's answer, so every rank raises the same kind (StaleWriter stops the run;
    a CheckpointSaveError with on_save_error=continue trains on: mixed, the ranks would hang). Here
    rank 1's own read would say the opposite of the coordinator's."""
    from checkpoint.durable import saver as saver_module
    from checkpoint.durable.lease import StaleWriter, take_lease
    from checkpoint.durable.saver import RankFailures
    from parallel import collectives

    mine, newer = take_lease(tmp_path), take_lease(tmp_path)  # the newer attempt owns it now
    saver = CheckpointSaver(tmp_path, "sync", rank=1, world_size=2, checksum_algorithm="crc32")
    saver.attempt = mine if not coordinator_saw_newer else newer  # what rank 1 alone would conclude: the opposite
    answer = f"{tmp_path} is owned by attempt {newer}" if coordinator_saw_newer else None
    words = None if coordinator_saw_newer else "there is no committed checkpoint yet"
    sent = []
    monkeypatch.setattr(saver_module, "_no_dist", lambda: False)
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: sent.append(obj) or (answer, words))
    failed = RankFailures("acknowledging the checkpoint files", {0: OSError(errno.ENOSPC, "No space left")})
    raised = saver._failed(failed, 4, checkpoint_dir(tmp_path, 4))
    assert sent == [None]  # rank 1 sends nothing of its own
    if coordinator_saw_newer:
        assert isinstance(raised, StaleWriter) and str(raised) == answer and raised.__cause__ is failed
    else:
        assert isinstance(raised, CheckpointSaveError) and raised.errno == errno.ENOSPC


def test_only_rank_0_lists_the_checkpoints_for_a_failed_saves_message(tmp_path, monkeypatch):
    """A save phase failed on every rank (ENOSPC on rank 0): the message names the newest committed checkpoint,
    which rank 0 alone lists (at 512 ranks: 512 listings and reads of every manifest, only for words); rank 1
    takes rank 0's words. Rank 0 runs first here and what it broadcasts is what rank 1 receives, in order."""
    from types import SimpleNamespace

    from checkpoint.durable import saver as saver_module
    from checkpoint.durable.saver import RankFailures
    from parallel import collectives

    failed = RankFailures("acknowledging the checkpoint files", {0: OSError(errno.ENOSPC, "No space left")})
    monkeypatch.setattr(saver_module, "_no_dist", lambda: False)
    sent, listed = [], []
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: sent.append(obj) or obj)
    monkeypatch.setattr(saver_module, "latest_committed",
                        lambda root: listed.append(root) or SimpleNamespace(checkpoint_id="step_00000010"))
    saver = CheckpointSaver(tmp_path, "sync", rank=0, world_size=2, checksum_algorithm="crc32")
    on_rank0 = saver._failed(failed, 20, checkpoint_dir(tmp_path, 20))
    assert len(listed) == 1

    received = list(sent)
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: received.pop(0))

    def must_not_list(*args, **kwargs):
        raise AssertionError("rank 1 listed the checkpoint directory")
    monkeypatch.setattr(saver_module, "latest_committed", must_not_list)
    saver = CheckpointSaver(tmp_path, "sync", rank=1, world_size=2, checksum_algorithm="crc32")
    raised = saver._failed(failed, 20, checkpoint_dir(tmp_path, 20))
    assert not received  # as many broadcasts as rank 0's
    for err in (on_rank0, raised):
        assert isinstance(err, CheckpointSaveError) and err.errno == errno.ENOSPC
        assert "nothing committed was touched: the newest committed checkpoint, step_00000010, is intact" in str(err)
