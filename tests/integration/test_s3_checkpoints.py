"""Checkpoints on S3 (``checkpoint.dir=s3://bucket/prefix``), against a real S3 endpoint: moto's
server on 127.0.0.1, started and stopped here (rehearsal/s3_server.py).

Every run is a 2-rank torchrun job of the tiny debug model, saving every 2 steps and keeping 2,
with multipart parts of 256 KiB, so each rank's data file is uploaded in about ten parts. The
uninterrupted run on a local disk is the reference: what S3 runs train, save and resume must
equal it bit for bit."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from checkpoint.durable.discovery import list_checkpoints
from checkpoint.durable.manifest import read_manifest, verify_checkpoint
from checkpoint.interop.export import export_safetensors, load_tensors
from checkpoint.storage import Loc
from metrics.records import read_metrics, step_losses
from rehearsal.chains import faults_override
from rehearsal.runs import tiny_overrides
from support.launch import load_script, python_or_torchrun, run_train
from support.processes import start, stop
from support.s3 import copy_tree, in_bucket, keys, open_uploads, serving

pytestmark = pytest.mark.distributed

STEPS, INTERVAL, KEEP, NPROC = 8, 2, 2, 2
SEED = 2026  # the kill points below are drawn from it


@pytest.fixture(scope="module")
def s3():
    with serving() as server:  # this process reads the bucket too
        yield server


def _overrides(run_dir: Path, data: Path, root, *extra, steps: int = STEPS, mode: str = "async"):
    return tiny_overrides(run_dir, data, steps, INTERVAL, keep_last=KEEP, async_mode=mode,
                          extra=[f"checkpoint.dir={root}", *extra])


def _train(s3, run_dir, data, root, *extra, nproc=NPROC, check=True, **kw):
    return run_train(_overrides(run_dir, data, root, *extra, **kw), nproc=nproc, check=check, extra_env=s3.env)


@pytest.fixture(scope="module")
def local(tmp_path_factory, pydoc_data, s3) -> Path:
    """The reference: the same run with checkpoint.dir on the local disk."""
    run_dir = tmp_path_factory.mktemp("s3") / "local"
    _train(s3, run_dir, pydoc_data, run_dir / "checkpoints")
    return run_dir


def _committed(root) -> list:
    return [c.checkpoint_id for c in list_checkpoints(root) if c.committed]


def _after(run_dir: Path, step: int) -> dict:
    return {s: x for s, x in step_losses(run_dir).items() if s > step}


def test_save_retention_resume_and_reshard_on_s3_equal_the_local_disk(s3, local, tmp_path, pydoc_data):
    run_dir, root = tmp_path / "s3", in_bucket("equal")
    _train(s3, run_dir, pydoc_data, root)
    assert step_losses(run_dir) == step_losses(local)
    assert _committed(root) == _committed(local / "checkpoints") == ["step_00000008", "step_00000006"]
    assert sorted({k.split("/")[0] for k in keys(root)}) == ["attempts", "latest", "step_00000006", "step_00000008"]
    for step in (6, 8):  # retention removed steps 2 and 4 whole; what is kept verifies and holds the same tensors
        ours, theirs = root / f"step_{step:08d}", local / "checkpoints" / f"step_{step:08d}"
        verify_checkpoint(ours)
        # Every tensor (model, optimizer, torch's generator...). The files' sizes may differ by a few bytes: the
        # pickled state of Python's global generator is in them, and the S3 client draws from it (botocore's retry
        # jitter calls random.random(); nothing in the trainer does).
        a, b = load_tensors(ours, ""), load_tensors(theirs, "")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    inspect = load_script("inspect_checkpoints").rows  # the inspect script lists S3 as it lists the disk
    ours, theirs = (inspect(r, True, KEEP, 0, 0, "loss") for r in (root, local / "checkpoints"))
    assert [(r["checkpoint_id"], r["state"], r["tier"], r["verified"]) for r in ours] == \
        [(r["checkpoint_id"], r["state"], r["tier"], r["verified"]) for r in theirs]
    # resharded to one rank (ranged reads of the slices it needs), from S3 and from the disk alike
    _train(s3, run_dir, pydoc_data, root, "checkpoint.resume=6", nproc=1)
    _train(s3, local, pydoc_data, local / "checkpoints", "checkpoint.resume=6", nproc=1)
    assert _after(run_dir, 6) == _after(local, 6)


def _killed_mid_upload(s3, run_dir: Path, data: Path, root: Loc, step: int, log_path: Path) -> None:
    """SIGKILL the job (its ranks die with it) while a data file of the save of ``step`` is
    half uploaded: parts sent, the upload not completed. The server holds each part 0.3 s, so a
    file's upload stays open long enough to be seen (a local one takes milliseconds)."""
    cmd = python_or_torchrun(NPROC, "train.py", *_overrides(run_dir, data, root))
    job = None
    with open(log_path, "w") as log:
        try:
            s3.delay_parts(0.3)
            job = start(cmd, log, extra_env=s3.env, warm=True)
            deadline = time.monotonic() + 240
            while not any(u["Key"].startswith(f"{root.key}/step_{step:08d}/") for u in open_uploads(s3)):
                assert job.poll() is None, f"the run ended before step {step}'s upload: {log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no upload was seen in flight"
                time.sleep(0.02)
            job.send_signal(signal.SIGKILL)
            job.wait()
        finally:
            if job is not None:
                stop(job)
            s3.delay_parts(0)


def test_a_sigkill_during_an_s3_save_leaves_no_trusted_torn_checkpoint(s3, local, tmp_path, pydoc_data):
    """A 2-rank train.py killed at a seeded step while a rank's file is half uploaded. (Every phase of
    a save, the move-aside, the upload and acknowledgement, the commit, `latest` and retention, each
    with its own SIGKILL and restart, one rank each: tests/integration/test_s3_protocol.py.)"""
    step = random.Random(f"{SEED}-mid-upload").choice([4, 6])
    run_dir, root = tmp_path / "killed", in_bucket("killed-mid-upload")
    _killed_mid_upload(s3, run_dir, pydoc_data, root, step, tmp_path / "job.log")
    assert any(u["Key"].startswith(f"{root.key}/") for u in open_uploads(s3))  # what the killed writer left
    for c in list_checkpoints(root):  # nothing torn is trusted: committed means complete and verified
        if c.committed:
            verify_checkpoint(c.path)
        assert c.step < step or not c.committed, c.checkpoint_id
    _train(s3, run_dir, pydoc_data, root)  # resume=auto
    assert read_metrics(run_dir, "resume")[-1]["step"] < step
    assert step_losses(run_dir) == step_losses(local)
    assert not [u for u in open_uploads(s3) if u["Key"].startswith(f"{root.key}/")]  # aborted at the start
    assert _committed(root) == ["step_00000008", "step_00000006"]


@pytest.fixture(scope="module")
def saved(s3, tmp_path_factory, pydoc_data) -> Loc:
    """A run's checkpoints on S3 (steps 6 and 8), copied for the test that damages them. The run finds
    the store by checkpoint.s3.endpoint_url alone: boto3's AWS_ENDPOINT_URL_S3 points where nothing listens."""
    root = in_bucket("saved")
    run_train(_overrides(tmp_path_factory.mktemp("s3") / "saved", pydoc_data, root,
                         f"checkpoint.s3.endpoint_url={s3.url}", "checkpoint.s3.addressing_style=path"),
              nproc=NPROC, extra_env={**s3.env, "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"})
    assert _committed(root) == ["step_00000008", "step_00000006"]
    return root


def test_a_damaged_object_is_found_and_the_resume_falls_back(s3, saved, tmp_path, pydoc_data):
    """train.py's resume on S3: a changed byte in rank 1's object of step 8 is found at load, the run
    falls back to step 6. (Every kind of damage, changed bytes, a missing object and a truncated
    upload, through the same verifier and fallback in one process: tests/integration/test_s3_protocol.py.)"""
    root = in_bucket("damaged")
    copy_tree(saved, root)
    victim = root / "step_00000008" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    _train(s3, run_dir, pydoc_data, root, steps=STEPS + 2)
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000006"
    # marked BAD and kept for people; the resumed run's save of step 8 went beside it
    bad = {c.checkpoint_id: c.bad for c in list_checkpoints(root) if c.bad}
    assert list(bad) == ["step_00000008"] and "__1_0.distcp" in list(bad.values())[0], bad
    assert verify_checkpoint(root / "step_00000008.r1").step == 8  # the new trajectory's save of step 8


def _save_alarms(run_dir: Path) -> list:
    return [a for a in read_metrics(run_dir, "alarm") if a.get("check") == "checkpoint_save"]


def _run_through_an_outage(s3, cmd, log_path: Path, run_dir: Path, root: Loc, after_step: int) -> int:
    """Run ``cmd``; once step ``after_step`` is committed, stop the endpoint (SIGSTOP: connections are
    accepted, nothing answers) until the next failed save is an alarm or the run ended; its exit code."""
    env = {**s3.env, "LLM_S3_READ_TIMEOUT_S": "2", "LLM_S3_CONNECT_TIMEOUT_S": "2", "LLM_S3_MAX_ATTEMPTS": "1"}
    alarms = len(_save_alarms(run_dir))
    with open(log_path, "w") as log:
        job = start(cmd, log, extra_env=env, warm=True)
        try:
            deadline = time.monotonic() + 240
            while not (root / f"step_{after_step:08d}" / "manifest.json").is_file():
                assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(s3.proc.pid, signal.SIGSTOP)
            try:
                while len(_save_alarms(run_dir)) == alarms and job.poll() is None:
                    assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                    time.sleep(0.1)
            finally:
                os.killpg(s3.proc.pid, signal.SIGCONT)
            return job.wait(timeout=240)
        finally:
            stop(job)


def test_the_server_stopped_during_a_save_stops_or_continues_by_on_save_error_and_training_resumes_once_back(
        s3, local, tmp_path, pydoc_data):
    """The endpoint stops answering right after a commit. With checkpoint.on_save_error=stop the save
    of step 6 fails and the run stops cleanly (exit 1, one message, steps 2 and 4 intact); once the
    endpoint answers again, a restart resumes from step 4 (steps 5 and 6 bit for bit those of the first
    run) and the failed save's open uploads are aborted. That restart, with on_save_error=continue, loses the
    endpoint after step 8: the save of step 10 fails, training goes on, step 12 commits; a second
    restart resumes from step 12 and no upload is left open."""
    run_dir, root, log_path = tmp_path / "outage", in_bucket("outage"), tmp_path / "job.log"
    slow = faults_override([{"kind": "slow", "phase": "step", "step": -1, "rank": 0, "delay_s": 0.25}])

    def cmd(policy: str):
        return python_or_torchrun(NPROC, "train.py", *_overrides(run_dir, pydoc_data, root, slow,
                                                                 f"checkpoint.on_save_error={policy}", steps=12,
                                                                 mode="sync"))

    code = _run_through_an_outage(s3, cmd("stop"), log_path, run_dir, root, after_step=4)
    out = log_path.read_text()
    assert code == 1 and "Traceback" not in out, out[-6000:]
    assert "error (rank 0): CheckpointSaveError: " in out, out[-6000:]
    block = out[out.index("error (rank 0): CheckpointSaveError: "):]
    assert "checkpoint of step 6 could not be saved: the object store failed or did not answer" in block, out[-6000:]
    # the save's first request (choosing its folder) got no answer: nothing was written, nothing is removed
    assert "(none made: the storage failed before the save chose its folder; nothing committed was touched: the " \
           "committed checkpoints could not be listed" in block  # not "no committed checkpoint yet"
    [alarm] = _save_alarms(run_dir)
    assert (alarm["step"], alarm["action"]) == (6, "stop") and max(r["step"] for r in read_metrics(run_dir)) == 6
    assert _committed(root) == ["step_00000004", "step_00000002"]
    for cid in _committed(root):
        verify_checkpoint(root / cid)
    left_open = {u["UploadId"] for u in open_uploads(s3, f"{root.key}/")}  # what the failed save could not abort
    before = step_losses(run_dir)  # steps 1..6, uninterrupted

    code = _run_through_an_outage(s3, cmd("continue"), log_path, run_dir, root, after_step=8)
    assert code == 0, log_path.read_text()[-6000:]
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000004"
    assert sorted(before) == [1, 2, 3, 4, 5, 6]
    resumed = step_losses(run_dir)  # the restart's rows come last: its steps 5 and 6
    assert {s: resumed[s] for s in (5, 6)} == {s: before[s] for s in (5, 6)}  # bit for bit
    assert not left_open & {u["UploadId"] for u in open_uploads(s3, f"{root.key}/")}  # aborted at the restart
    failed = _save_alarms(run_dir)[-1]
    assert (failed["step"], failed["action"]) == (10, "continue"), failed
    committed = _committed(root)
    assert committed[0] == "step_00000012" and "step_00000010" not in committed
    for cid in committed:
        verify_checkpoint(root / cid)
    _train(s3, run_dir, pydoc_data, root, "checkpoint.on_save_error=continue", steps=14, mode="sync")
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000012"
    assert not open_uploads(s3, f"{root.key}/")


def test_a_run_starts_from_an_s3_checkpoint_with_model_init_from(s3, saved, local, tmp_path, pydoc_data):
    """model.init_from=s3://.../step_N: the weights (verified against their checksums) equal the same
    checkpoint's on a local disk, so the first losses are bit for bit those of init_from the disk."""
    runs = {}
    for name, source in (("from-s3", saved / "step_00000006"), ("from-disk", local / "checkpoints" / "step_00000006")):
        runs[name] = tmp_path / name
        _train(s3, runs[name], pydoc_data, runs[name] / "checkpoints", f"model.init_from={source}", steps=2, nproc=1)
    assert step_losses(runs["from-s3"]) == step_losses(runs["from-disk"])
    record = read_manifest(runs["from-s3"] / "checkpoints" / "step_00000002").init_from
    assert (record["path"], record["kind"]) == (f"{saved}/step_00000006", "checkpoint")


def test_an_s3_checkpoint_converts_and_exports_to_a_disk(s3, saved, tmp_path):
    """scripts/convert_checkpoint.py's conversion and scripts/export.py read a checkpoint from S3 and
    write to a disk: stock DCP files (committed, verified) and a safetensors file of the same tensors."""
    from checkpoint.interop.convert import convert_to_dcp

    dst = tmp_path / "step_00000006"
    convert_to_dcp(saved / "step_00000006", dst)
    verify_checkpoint(dst)
    a, b = load_tensors(saved / "step_00000006", "model."), load_tensors(dst, "model.")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    export_safetensors(saved / "step_00000006", tmp_path / "model.safetensors")  # scripts/export.py's
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "model.safetensors")
    assert set(a) <= set(exported) and all(torch.equal(exported[k], a[k]) for k in a)
