"""Checkpoints on S3 (``checkpoint.dir=s3://bucket/prefix``), against a real S3 endpoint: moto's
server on 127.0.0.1, started and stopped here (tools/s3_server.py).

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
from checkpoint.s3.path import S3Path
from helpers.launch import load_script, python_or_torchrun, run_train
from helpers.processes import start, stop
from metrics.records import read_metrics, step_losses
from tools.rehearsal import faults_override
from tools.runs import tiny_overrides
from tools.s3_server import BUCKET, S3Server

pytestmark = pytest.mark.distributed

STEPS, INTERVAL, KEEP, NPROC = 8, 2, 2, 2
SEED = 2026  # the kill points below are drawn from it


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    server.make_bucket()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # this process reads the bucket too
    yield server
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.stop()


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


def _prefix(name: str) -> S3Path:
    return S3Path(f"s3://{BUCKET}/{name}")


def _committed(root) -> list:
    return [c.checkpoint_id for c in list_checkpoints(root) if c.committed]


def _after(run_dir: Path, step: int) -> dict:
    return {s: x for s, x in step_losses(run_dir).items() if s > step}


def test_save_retention_resume_and_reshard_on_s3_equal_the_local_disk(s3, local, tmp_path, pydoc_data):
    run_dir, root = tmp_path / "s3", _prefix("equal")
    _train(s3, run_dir, pydoc_data, root)
    assert step_losses(run_dir) == step_losses(local)
    assert _committed(root) == _committed(local / "checkpoints") == ["step_00000008", "step_00000006"]
    assert sorted({k.split("/")[1] for k in root.keys()}) == ["attempts", "latest", "step_00000006", "step_00000008"]
    for step in (6, 8):  # retention removed steps 2 and 4 whole; what is kept verifies and holds the same tensors
        ours, theirs = root / f"step_{step:08d}", local / "checkpoints" / f"step_{step:08d}"
        verify_checkpoint(ours)
        for part in ("model.", "optim."):
            a, b = load_tensors(ours, part), load_tensors(theirs, part)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    inspect = load_script("inspect_checkpoints").rows  # the inspect script lists S3 as it lists the disk
    ours, theirs = (inspect(r, True, KEEP, 0, 0, "loss") for r in (root, local / "checkpoints"))
    assert [(r["checkpoint_id"], r["state"], r["tier"], r["verified"]) for r in ours] == \
        [(r["checkpoint_id"], r["state"], r["tier"], r["verified"]) for r in theirs]
    assert [round(r["size_mib"], 3) for r in ours] == [round(r["size_mib"], 3) for r in theirs]
    # resharded to one rank (ranged reads of the slices it needs), from S3 and from the disk alike
    _train(s3, run_dir, pydoc_data, root, "checkpoint.resume=6", nproc=1)
    _train(s3, local, pydoc_data, local / "checkpoints", "checkpoint.resume=6", nproc=1)
    assert _after(run_dir, 6) == _after(local, 6)


def _open_uploads(s3) -> list:
    return s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])


def _killed_mid_upload(s3, run_dir: Path, data: Path, root: S3Path, step: int, log_path: Path) -> None:
    """SIGKILL the job (its ranks die with it) while a data file of the save of ``step`` is
    half uploaded: parts sent, the upload not completed."""
    cmd = python_or_torchrun(NPROC, "train.py", *_overrides(run_dir, data, root))
    with open(log_path, "w") as log:
        job = start(cmd, log, extra_env=s3.env, warm=True)
        try:
            deadline = time.monotonic() + 240
            while not any(u["Key"].startswith(f"{root.key}/step_{step:08d}/") for u in _open_uploads(s3)):
                assert job.poll() is None, f"the run ended before step {step}'s upload: {log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no upload was seen in flight"
                time.sleep(0.02)
            job.send_signal(signal.SIGKILL)
            job.wait()
        finally:
            stop(job)


@pytest.mark.parametrize("point", ["mid-upload", "checkpoint_commit"])
def test_a_sigkill_during_an_s3_save_leaves_no_trusted_torn_checkpoint(s3, local, tmp_path, pydoc_data, point):
    """Killed at a seeded step: while a rank's file is half uploaded, or with every acknowledgement in
    and no manifest yet (rank 0). (A kill between the upload and the acknowledgement is the
    disk's case: tests/test_recovery_killpoints.py; the protocol's phases are the same code.)"""
    step = random.Random(f"{SEED}-{point}").choice([4, 6])
    run_dir, root = tmp_path / "killed", _prefix(f"killed-{point}")
    if point == "mid-upload":
        _killed_mid_upload(s3, run_dir, pydoc_data, root, step, tmp_path / "job.log")
        assert any(u["Key"].startswith(f"{root.key}/") for u in _open_uploads(s3))  # what the killed writer left
    else:
        kill = {"kind": "sigkill", "phase": point, "step": step, "rank": 0}
        killed = _train(s3, run_dir, pydoc_data, root, faults_override([kill]), check=False, mode="sync")
        assert killed.returncode != 0
    for c in list_checkpoints(root):  # nothing torn is trusted: committed means complete and verified
        if c.committed:
            verify_checkpoint(c.path)
        assert c.step < step or not c.committed, c.checkpoint_id
    _train(s3, run_dir, pydoc_data, root)  # resume=auto
    assert read_metrics(run_dir, "resume")[-1]["step"] < step
    assert step_losses(run_dir) == step_losses(local)
    assert not [u for u in _open_uploads(s3) if u["Key"].startswith(f"{root.key}/")]  # aborted at the start
    assert _committed(root) == ["step_00000008", "step_00000006"]


@pytest.fixture(scope="module")
def saved(s3, tmp_path_factory, pydoc_data) -> S3Path:
    """A run's checkpoints on S3 (steps 6 and 8), copied for each test that damages them."""
    root = _prefix("saved")
    _train(s3, tmp_path_factory.mktemp("s3") / "saved", pydoc_data, root)
    return root


@pytest.mark.parametrize("damage", ["changed bytes", "truncated upload"])
def test_a_damaged_object_is_found_and_the_resume_falls_back(s3, saved, tmp_path, pydoc_data, damage):
    root = _prefix(f"damaged-{damage.replace(' ', '-')}")
    saved.copy_tree(root)
    victim = root / "step_00000008" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    if damage == "changed bytes":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "missing object":
        victim.unlink()
    else:
        victim.write_bytes(bytes(data[: len(data) // 3]))
    run_dir = tmp_path / "run"
    _train(s3, run_dir, pydoc_data, root, steps=STEPS + 2)
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000006"
    # marked BAD, then moved aside (kept for people) when the resumed run saved step 8 again
    bad = {c.checkpoint_id: c.bad for c in list_checkpoints(root) if c.bad}
    assert [b.split(".")[0] for b in bad] == ["step_00000008"] and "__1_0.distcp" in list(bad.values())[0], bad
    assert verify_checkpoint(root / "step_00000008").step == 8  # the new trajectory's save of step 8


def _save_alarms(run_dir: Path) -> list:
    return [a for a in read_metrics(run_dir, "alarm") if a.get("check") == "checkpoint_save"]


def test_the_server_stopped_during_a_save_fails_it_cleanly_and_training_resumes_once_it_is_back(
        s3, local, tmp_path, pydoc_data):
    """The endpoint stops answering (its process stopped) after step 4 is committed: the save of
    step 6 fails by checkpoint.on_save_error=continue and training goes on; once the endpoint
    answers again the next saves commit, and a restart resumes from them."""
    run_dir, root = tmp_path / "outage", _prefix("outage")
    env = {**s3.env, "LLM_S3_READ_TIMEOUT_S": "2", "LLM_S3_CONNECT_TIMEOUT_S": "2", "LLM_S3_MAX_ATTEMPTS": "1"}
    slow = faults_override([{"kind": "slow", "phase": "step", "step": -1, "rank": 0, "delay_s": 0.25}])
    cmd = python_or_torchrun(NPROC, "train.py", *_overrides(run_dir, pydoc_data, root, slow, "checkpoint.interval=2",
                                                           "checkpoint.on_save_error=continue", steps=12, mode="sync"))
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log:
        job = start(cmd, log, extra_env=env, warm=True)
        try:
            deadline = time.monotonic() + 240
            while not (root / "step_00000004" / "manifest.json").is_file():
                assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(s3.proc.pid, signal.SIGSTOP)
            try:
                while not _save_alarms(run_dir):
                    assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                    time.sleep(0.1)
            finally:
                os.killpg(s3.proc.pid, signal.SIGCONT)
            assert job.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        finally:
            stop(job)
    failed = _save_alarms(run_dir)
    assert failed and failed[0]["step"] >= 6 and failed[0]["action"] == "continue", failed
    committed = _committed(root)
    assert committed[0] == "step_00000012" and f"step_{failed[0]['step']:08d}" not in committed
    for cid in committed:
        verify_checkpoint(root / cid)
    _train(s3, run_dir, pydoc_data, root, "checkpoint.on_save_error=continue", steps=14, mode="sync")
    assert read_metrics(run_dir, "resume")[-1]["checkpoint_id"] == "step_00000012"


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
