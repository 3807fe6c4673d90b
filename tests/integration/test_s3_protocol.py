"""The S3 commit protocol piece by piece, against a real S3 endpoint (moto's server on 127.0.0.1,
rehearsal/s3_server.py), in this process or in one small process per kill: the objects and streams, the
conditional PUT the commit relies on, the bytes each rank fetches, damage and the fallback, the
lease and the pre-flight, the endpoint setting, and a SIGKILL at every phase of a save.

The state saved is small (support/s3.py: two 256x256 layers and AdamW's moments, about 1.5 MiB, in
256 KiB parts) and goes through the real CheckpointManager, saver, loader and recovery/resume.py;
tests/integration/test_s3_checkpoints.py runs train.py itself on S3. The fast loop (-m "not distributed") runs
the tests of the objects, streams, conditional PUT, ranged reads and endpoint (seconds, the server's
start included); those that save through the manager are marked distributed."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from checkpoint.durable.discovery import (
    BAD_MARKER,
    committed_dir,
    list_checkpoints,
    list_committed,
    mark_bad,
    read_latest_pointer,
)
from checkpoint.durable.manifest import CheckpointError, read_manifest, verify_checkpoint
from checkpoint.durable.saver import commit_checkpoint
from checkpoint.storage import Loc, location
from checkpoint.storage.s3 import config as s3_settings
from checkpoint.storage.s3 import store as s3_client
from checkpoint.storage.s3.store import MultipartWriter, RangedReader
from configs.keys import problems
from rehearsal.s3_server import BUCKET, PART_BYTES
from support.s3 import (
    KILL_POINTS,
    adopt,
    answer_lost,
    copy_tree,
    in_bucket,
    keys,
    manager,
    open_uploads,
    protocol_config,
    serving,
    tensors_of,
    tiny_state,
)


@pytest.fixture(scope="module")
def s3():
    with serving() as server:
        yield server


def _trusted(root) -> list:
    """The steps a resume may choose: committed, not BAD."""
    return [c.step for c in list_committed(root)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- objects and streams --------------------------------------------------------------------------
def test_an_s3_location_names_like_pathlib_and_refuses_what_is_no_s3_url():
    p = location("s3://bucket/run/checkpoints/")
    assert (str(p), p.store.bucket, p.key, p.name) == ("s3://bucket/run/checkpoints", "bucket", "run/checkpoints",
                                                       "checkpoints")
    child = p / "step_00000002" / "manifest.json"
    assert str(child) == "s3://bucket/run/checkpoints/step_00000002/manifest.json"
    assert child.parent.parent == p and child.with_name("acks").name == "acks"
    assert str(location("s3://bucket").parent) == "s3://bucket" and location("s3://b/a") / "" == location("s3://b/a")
    assert p.local_path() is None
    with pytest.raises(TypeError, match="is not a local path"):  # never written into a local folder named "s3:"
        open(p / "x", "wb")
    with pytest.raises(ValueError, match="names no bucket"):
        location("s3:///prefix")


def test_a_file_is_uploaded_in_parts_read_back_by_exact_ranges_and_an_abandoned_upload_is_aborted(s3):
    data = torch.randint(0, 256, (5 * PART_BYTES // 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data = data.numpy().tobytes()  # two and a half parts
    obj = in_bucket("streams") / "file.distcp"
    with MultipartWriter(BUCKET, obj.key) as w:
        for i in range(0, len(data), 100_000):  # writes smaller than a part, as DCP's items are
            w.write(data[i:i + 100_000])
        assert w._upload_id is not None and len(w._sent) == 2  # two full parts sent while writing
    assert obj.read_bytes() == data and obj.stat().st_size == len(data)
    assert s3.client().head_object(Bucket=BUCKET, Key=obj.key, PartNumber=1)["PartsCount"] == 3

    asked = []
    s3_client.client().meta.events.register("before-parameter-build.s3.GetObject", lambda params, **kw: asked.append(
        params.get("Range")), unique_id="ranges")
    try:
        r = RangedReader(BUCKET, obj.key)
        r.seek(PART_BYTES - 10)
        buf = bytearray(30)
        assert r.readinto(buf) == 30 and bytes(buf) == data[PART_BYTES - 10:PART_BYTES + 20]
        r.seek(-5, 2)
        assert r.read() == data[-5:] and r.read(10) == b""
    finally:
        s3_client.client().meta.events.unregister("before-parameter-build.s3.GetObject", unique_id="ranges")
    assert asked == [f"bytes={PART_BYTES - 10}-{PART_BYTES + 19}", f"bytes={len(data) - 5}-{len(data) - 1}"]

    left = MultipartWriter(BUCKET, in_bucket("streams").key + "/left.distcp")
    left.write(data)  # parts sent, never completed: what a killed writer leaves
    abandoned = MultipartWriter(BUCKET, in_bucket("streams").key + "/abandoned.distcp")
    abandoned.write(data)
    abandoned.abort()  # a failed writer gives up: its parts are deleted, nothing becomes visible
    assert [u["Key"] for u in open_uploads(s3, "streams/")] == ["streams/left.distcp"]
    assert in_bucket("streams").abort_unfinished() == ["streams/left.distcp"]
    assert not open_uploads(s3, "streams/") and keys(in_bucket("streams")) == ["file.distcp"]


def test_the_server_refuses_a_second_conditional_put_of_a_manifest(s3):
    """The commit is the manifest PUT with If-None-Match: * (checkpoint/storage/s3/store.py create). A second
    commit of the same step (another writer, a replayed request) must be refused by the server and
    leave the first manifest as it was; a store that ignored the header would let it through."""
    root = in_bucket("conditional")
    final = root / "step_00000010"
    (final / "__0_0.distcp").write_bytes(b"x" * 100)
    first = read_manifest_like(10)
    assert commit_checkpoint(final, first) == final
    second = replace(first, loss=9.0, created_at=first.created_at + 1)
    with pytest.raises(CheckpointError, match="a manifest exists already") as raised:
        commit_checkpoint(final, second)
    assert isinstance(raised.value.__cause__, FileExistsError)
    assert "PreconditionFailed" in str(raised.value.__cause__)
    assert read_manifest(final).loss == first.loss == 1.5


def test_a_conditional_create_whose_answer_was_lost_is_this_writers_own(s3):
    """The first conditional PUT landed, its answer was lost, botocore's retry met the object it had just
    created (412): the create succeeded. Bytes another writer put there before the retry are still refused."""
    root = in_bucket("lost-answer")
    with answer_lost("/mine") as dropped:
        (root / "mine").create_bytes(b"this writer's record")
    assert dropped == [f"{s3.url}/{BUCKET}/lost-answer/mine"]
    assert (root / "mine").read_bytes() == b"this writer's record"

    def another_writer() -> None:
        s3.client().put_object(Bucket=BUCKET, Key=f"{root.key}/theirs", Body=b"another writer's record")
    with answer_lost("/theirs", meanwhile=another_writer) as dropped:
        with pytest.raises(FileExistsError, match="PreconditionFailed"):
            (root / "theirs").create_bytes(b"this writer's record")
    assert dropped and (root / "theirs").read_bytes() == b"another writer's record"
    root.rmtree()


@pytest.mark.distributed  # the manager's saves and loads
def test_a_lost_answer_to_the_manifest_put_leaves_the_step_committed_and_the_run_going(s3):
    """The answer to step 2's manifest PUT is lost and the retry gets 412: step 2 is committed, intact and this
    run's own; the run goes on (the next save commits, ``latest`` moves) and resumes from step 4 bitwise."""
    from recovery.resume import resume

    root = in_bucket("lost-manifest-answer")
    cfg = protocol_config(str(root), on_save_error="continue")
    state = tiny_state(2)
    with manager(cfg, state) as mgr:
        with answer_lost("/step_00000002/manifest.json") as dropped:
            mgr.after_step(2, 1.0)
        assert dropped
        adopt(state, tiny_state(4))
        mgr.after_step(4, 1.0)
    assert _trusted(root) == [4, 2] and read_latest_pointer(root) == "step_00000004"
    assert [verify_checkpoint(c.path).step for c in list_checkpoints(root)] == [4, 2]  # no second save of a step
    resumed = tiny_state(0, trajectory=9)
    with manager(cfg, resumed) as mgr:
        resume(mgr)
    assert resumed.step == 4 and _same(tensors_of(resumed), tensors_of(tiny_state(4)))
    root.rmtree()


@pytest.mark.distributed  # the manager's pre-flight
def test_a_lost_answer_to_the_lease_put_leaves_the_lease_this_launchs(s3):
    """The answer to the PUT of attempts/attempt_000001 is lost and the retry gets 412: the launch holds attempt
    1 (it does not refuse itself as a live run, nor take attempt 2) and saves under it."""
    root = in_bucket("lost-lease-answer")
    cfg = protocol_config(str(root))
    with answer_lost("/attempts/attempt_000001") as dropped:
        with manager(cfg, tiny_state(2)) as mgr:
            assert mgr.saver.attempt == 1
            mgr.after_step(2, 1.0)
    assert dropped and _trusted(root) == [2]
    assert keys(root / "attempts") == ["attempt_000001", "attempt_000001.released"]
    root.rmtree()


def read_manifest_like(step: int):
    from checkpoint.durable.manifest import FileEntry, Manifest

    return Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "hash", {"seed": 1}, 1, {"dp_shard": 1}, 8, 1.5, None,
                    None, {"__0_0.distcp": FileEntry(100, None)})


# -- the small state saved and loaded by the real manager -----------------------------------------
@pytest.fixture(scope="module")
def base(s3, tmp_path_factory):
    """Steps 2 and 4 of trajectory 0 committed on S3 by the CheckpointManager, and its config as
    YAML (what the worker processes read). Each test copies them to its own prefix (server-side)."""
    root = in_bucket("base")
    cfg = protocol_config(str(root))
    for step in (2, 4):
        with manager(cfg, tiny_state(step)) as mgr:
            mgr.save(step, 1.0)
    assert _trusted(root) == [4, 2]
    return root


def _copy(base: Loc, name: str):
    root = in_bucket(name)
    copy_tree(base, root)
    return root, protocol_config(str(root))


@pytest.mark.distributed  # the manager's saves and loads: seconds each, left out of the fast loop
@pytest.mark.parametrize("damage", ["changed bytes", "missing object", "truncated upload"])
def test_a_damaged_object_is_found_and_the_resume_falls_back(s3, base, damage):
    """Step 4's data object changed, deleted, or replaced by a third of itself (as if an upload had
    been cut short and completed): the verified load finds it, resume marks step 4 BAD and loads step 2
    bit for bit; when the resumed run saves step 4 again, the save goes beside the BAD one (kept, untouched)."""
    root, cfg = _copy(base, f"damaged-{damage.replace(' ', '-')}")
    victim = root / "step_00000004" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    if damage == "changed bytes":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "missing object":
        victim.unlink()
    else:
        victim.write_bytes(bytes(data[: len(data) // 3]))
    state = tiny_state(0, trajectory=9)
    with manager(cfg, state) as mgr:
        from recovery.resume import resume

        assert "after skipping step_00000004" in resume(mgr)
        assert state.step == 2 and _same(tensors_of(state), tensors_of(tiny_state(2)))
        bad = (root / "step_00000004" / BAD_MARKER).read_text()
        assert "__0_0.distcp" in bad, bad
        adopt(state, tiny_state(4, trajectory=1))
        mgr.save(4, 1.0)
    assert _trusted(root) == [4, 2] and committed_dir(root, 4).name == "step_00000004.r1"
    assert verify_checkpoint(committed_dir(root, 4)).step == 4
    [aside] = [c for c in list_checkpoints(root) if c.replaced]
    assert aside.checkpoint_id == "step_00000004" and (aside.path / BAD_MARKER).read_text() == bad  # kept


@pytest.mark.distributed  # the manager's saves and loads
def test_a_resave_of_a_committed_step_copies_nothing_and_leaves_the_old_save_committed(s3, base):
    """checkpoint.resume=2 while step 4 is committed (a rollback and a fallback go back the same way), then step 4
    is saved again, on a store whose server-side copy is slow (10 s an object here; at 70B about 850 GB of
    copies, and S3 copies nothing over 5 GB in one request). The re-save copies nothing and deletes nothing of
    the old save, which stays committed throughout: it goes under a new prefix (step_00000004.r1) and commits by
    its manifest in less than the commit timeout, the bound of the agreement every other rank waits in; a
    resume then loads it bit for bit, and the old save is kept for people."""
    import time

    from recovery.resume import resume

    root, _ = _copy(base, "resave")
    calls = []

    def record(model, params, **kw):
        deleted = [o["Key"] for o in params.get("Delete", {}).get("Objects", [])]
        calls.append((model.name, [params.get("Key", ""), *deleted]))

    c = s3_client.client()
    state = tiny_state(0, trajectory=9)
    s3.delay_copies(10)
    try:
        with manager(protocol_config(str(root), resume=2, commit_timeout_s=10), state) as mgr:
            resume(mgr)
            assert state.step == 2
            adopt(state, tiny_state(4, trajectory=1))  # trained on from step 2: another step 4
            c.meta.events.register("before-parameter-build.s3", record, unique_id="resave")
            t0 = time.monotonic()
            mgr.after_step(4, 1.0)
            took = time.monotonic() - t0
            c.meta.events.unregister("before-parameter-build.s3", unique_id="resave")
    finally:
        c.meta.events.unregister("before-parameter-build.s3", unique_id="resave")
        s3.delay_copies(0)
    assert ("PutObject", [f"{root.key}/step_00000004.r1/manifest.json"]) in calls  # the commit, recorded
    assert not [op for op, _ in calls if "Copy" in op], calls
    old = f"{root.key}/step_00000004/"
    assert not [(op, k) for op, ks in calls if op.startswith("Delete") for k in ks if k.startswith(old)], calls
    assert took < 10, took
    assert committed_dir(root, 4).name == "step_00000004.r1" and _trusted(root) == [4, 2]
    assert verify_checkpoint(root / "step_00000004").step == 4  # the old save: committed, intact, superseded
    resumed = tiny_state(0, trajectory=8)
    with manager(protocol_config(str(root)), resumed) as mgr:
        resume(mgr)
    assert resumed.step == 4 and _same(tensors_of(resumed), tensors_of(tiny_state(4, trajectory=1)))
    root.rmtree()


# -- what each rank fetches -------------------------------------------------------------------
class _RowBlockPlanner(DefaultLoadPlanner):
    """DCP's load planner for a destination that is one rank's block of rows: a DTensor's shard is
    found by its offsets; here the destination is that block itself."""

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


def test_a_rank_fetches_only_the_slices_it_loads(s3):
    """A checkpoint saved by one rank, loaded by two (DCP's read items for a dim-0 shard of each
    rank, as its planner makes them for a sharded destination): each rank GETs exactly the bytes of
    its rows. With verification on, the rank that checksums the file (file k by rank k % 2) reads it
    whole, once; the other still fetches only its rows."""
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from checkpoint.durable.loader import verification_shares
    from checkpoint.durable.manifest import default_algorithm
    from checkpoint.durable.raw import RawFileWriter
    from checkpoint.durable.reader import RawFileReader

    g = torch.Generator().manual_seed(0)
    saved = {k: torch.randn(256, 256, generator=g) for k in ("model.0.weight", "optim.exp_avg", "optim.exp_avg_sq")}
    path, algorithm = in_bucket("ranged") / "step_00000002", default_algorithm()
    writer = RawFileWriter(path, algorithm)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    file_size = writer.written["__0_0.distcp"].size
    manifest = SimpleNamespace(files=writer.written)  # what verification_shares reads of a manifest
    want, rows = saved["model.0.weight"], 128
    fetched = []

    def count(parsed, **kw):
        fetched.append(int(parsed["ContentLength"]))

    c = s3_client.client()
    c.meta.events.register("after-call.s3.GetObject", count, unique_id="fetched")
    try:
        for verify in (False, True):
            for rank in (0, 1):
                reader = RawFileReader(path, algorithm=algorithm,
                                       verify=verification_shares(manifest, rank, 2)[1] if verify else None)
                meta = reader.read_metadata()
                reader.set_up_storage_reader(meta, rank == 0)
                dest = torch.zeros(rows, want.shape[1])
                planner = _RowBlockPlanner()
                planner.set_up_planner({"model.0.weight": dest}, meta, rank == 0)
                chunk = ChunkStorageMetadata(offsets=torch.Size([rank * rows, 0]), sizes=dest.shape)
                items = create_read_items_for_chunk_list("model.0.weight", meta.state_dict_metadata["model.0.weight"],
                                                         [chunk])
                fetched.clear()
                reader.read_data(LoadPlan(items), planner).wait()
                assert not reader.problems and not reader.unreadable
                assert torch.equal(dest, want[rank * rows:(rank + 1) * rows])
                expected = file_size if verify and rank == 0 else dest.numel() * 4
                assert sum(fetched) == expected, (verify, rank, fetched, expected)
    finally:
        c.meta.events.unregister("after-call.s3.GetObject", unique_id="fetched")
    assert dest.numel() * 4 * 6 == file_size  # a rank's rows are a sixth of the file


# -- the lease, the pre-flight, the endpoint ------------------------------------------------------
@pytest.mark.distributed  # the manager's pre-flight: left out of the fast loop
def test_a_live_owner_is_refused_and_a_missing_bucket_named_before_anything_is_written(s3, base):
    from checkpoint.checks import resume_problems
    from checkpoint.durable.lease import LiveOwner
    from checkpoint.durable.preflight import PreflightError
    from trainer.config import typed

    root, cfg = _copy(base, "leased")
    with manager(cfg, tiny_state(4)):  # a live run: its lease held, its heartbeat beating
        [problem] = resume_problems(typed(cfg)[0])
        assert problem.startswith(f"checkpoint.dir: {root} is in use by a live run: attempt ")
        before = keys(root)
        with pytest.raises(LiveOwner, match="is in use by a live run"):
            with manager(cfg, tiny_state(4)):
                pass
        assert keys(root) == before  # nothing written by the refused launch
    assert resume_problems(typed(cfg)[0]) == []  # released when the run closed

    missing = protocol_config("s3://no-such-bucket/run/checkpoints")
    assert resume_problems(typed(missing)[0]) == []  # the checks' probe reads nothing there: no committed checkpoint
    with pytest.raises(PreflightError, match=r"checkpoint.dir=s3://no-such-bucket/run/checkpoints is not writable "
                                             r"by this process: .*bucket 'no-such-bucket' does not exist: create it, "
                                             r"or point checkpoint.dir at an existing bucket"):
        with manager(missing, tiny_state(4)):
            pass


def test_the_endpoint_comes_from_checkpoint_s3_before_the_environment(s3, monkeypatch):
    """checkpoint.s3.endpoint_url (configure) wins over AWS_ENDPOINT_URL_S3; region and path-style
    addressing reach boto3; bad values are named by the config checks."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
    sent = []
    try:
        s3_settings.configure(s3.url, "eu-west-1", "path")
        c = s3_client.client()
        c.meta.events.register("before-send.s3", lambda request, **kw: sent.append(request.url), unique_id="u")
        assert in_bucket("").is_dir()
        assert (c.meta.endpoint_url, c.meta.region_name, c.meta.config.s3) == (
            s3.url, "eu-west-1", {"addressing_style": "path"})
        assert sent and all(u.startswith(f"{s3.url}/{BUCKET}") for u in sent), sent
        s3_settings.configure(None)  # back to the environment's endpoint, where nothing answers
        with pytest.raises(OSError, match="S3 endpoint unreachable"):
            in_bucket("").walk()
    finally:
        s3_settings.configure(None)
    bad = s3_settings.S3Config("minio:9000", "", "sideways")
    assert problems(bad, "checkpoint.s3") == [
        "checkpoint.s3.addressing_style='sideways': choose one of ['auto', 'path', 'virtual']",
        "checkpoint.s3.endpoint_url='minio:9000': give the store's URL with its scheme, e.g. "
        "http://minio.internal:9000 or https://s3.us-east-1.amazonaws.com (null: boto3's own settings)",
        "checkpoint.s3.region='': give a region name (us-east-1) or null"]


# -- a SIGKILL at every phase of a save ---------------------------------------------------------------
# The point, the save the killed process makes (step, trajectory; step 4 again: after step 4 was
# found BAD, so the new save goes beside it, as step_00000004.r1), the steps trusted after the kill.
KILLS = {
    "re-save of a BAD step: parts sent, the upload not completed": ((4, 1), [2]),
    "re-save of a BAD step: committed, latest not moved": ((4, 1), [4, 2]),
    "upload: parts sent, the upload not completed": ((6, 0), [4, 2]),
    ".metadata: written, not acknowledged": ((6, 0), [4, 2]),
    "uploaded, not acknowledged": ((6, 0), [4, 2]),
    "acknowledged, no manifest": ((6, 0), [4, 2]),
    "manifest written, latest not moved": ((6, 0), [6, 4, 2]),
    "committed, retention not begun": ((6, 0), [6, 4, 2]),
    "retention: the manifest deleted, the objects not": ((6, 0), [6, 4]),
}


def test_every_kill_point_of_the_worker_has_its_expected_outcome():
    """KILLS (this file) and KILL_POINTS (where the worker can die) name the same points: none untested."""
    assert set(KILLS) == set(KILL_POINTS)


@pytest.mark.distributed
@pytest.mark.parametrize("point", list(KILLS))
def test_a_sigkill_at_any_phase_of_an_s3_save_leaves_no_trusted_torn_checkpoint(s3, base, tmp_path, point):
    """A process saving with the real manager is SIGKILLed at ``point`` (tests/support/workers/s3_save_worker.py).
    After it: every committed checkpoint verifies and the trusted ones are the previous state or the new
    one. A restart (this process) resumes the newest bit for bit, removes the interrupted save's objects
    and aborts its open uploads, saves the next step and retention leaves exactly what it should."""
    from omegaconf import OmegaConf

    from support.launch import run, worker

    (step, trajectory), trusted = KILLS[point]
    root, cfg = _copy(base, f"kill-{list(KILLS).index(point)}")
    if step == 4:
        mark_bad(root / "step_00000004", "found damaged (test)")
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    proc = run([sys.executable, worker("s3_save_worker"), str(tmp_path / "config.yaml"), str(step), str(trajectory),
                point], timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed where it was asked to die

    for c in list_checkpoints(root):  # nothing torn is trusted: committed means complete and verified
        if c.committed:
            verify_checkpoint(c.path)
    assert _trusted(root) == trusted
    if point == "manifest written, latest not moved":
        assert read_latest_pointer(root) == "step_00000004"  # a stale hint, which discovery does not trust
    if point.endswith("the upload not completed"):
        assert open_uploads(s3, f"{root.key}/{'step_00000006' if step == 6 else 'step_00000004.r1'}/")
    if step == 4:  # the BAD save is never touched by the new one
        assert verify_checkpoint(root / "step_00000004").step == 4 and (root / "step_00000004" / BAD_MARKER).is_file()

    from recovery.resume import resume

    state = tiny_state(0, trajectory=9)  # the restart: other values everywhere until it loads
    with manager(cfg, state) as mgr:
        resume(mgr)
        newest = state.step
        saved = tiny_state(newest, trajectory if newest == step else 0)  # the killed save, if it committed
        assert newest == trusted[0] and _same(tensors_of(state), tensors_of(saved))
        assert not open_uploads(s3, f"{root.key}/")  # aborted at the restart
        adopt(state, tiny_state(newest + 2, trajectory=1))  # trained on: its next save
        mgr.save(newest + 2, 1.0)
    kept = [c for c in list_checkpoints(root) if c.committed and not c.replaced]
    assert _trusted(root) == [newest + 2, newest] == [c.step for c in kept]
    for c in kept:
        verify_checkpoint(c.path)
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted(["attempts", "latest", *[c.checkpoint_id for c in list_checkpoints(root)]])
    assert [c.checkpoint_id for c in list_checkpoints(root) if c.replaced] == (["step_00000004"] if step == 4 else [])
    assert all(c.committed for c in list_checkpoints(root))  # the interrupted save's objects are gone
    assert read_latest_pointer(root) == kept[0].checkpoint_id


# -- many checkpoints on a slow store: rank 0 lists and reads while the others wait -----------------------
MANY = 100  # committed folders under the prefix


def _many_checkpoints(name: str) -> Loc:
    """MANY committed checkpoints: steps 398 (verified) and 400 (saved after an alarm, so not verified) by the
    manager, and 198 older ones that are only their manifests (a listing reads nothing else of them)."""
    from checkpoint.durable.discovery import checkpoint_id
    from checkpoint.durable.manifest import MANIFEST

    root = in_bucket(name)
    cfg = protocol_config(str(root), keep_last=1000)
    with manager(cfg, tiny_state(398)) as mgr:
        mgr.save(398, 1.0)
    with manager(cfg, tiny_state(400)) as mgr:
        mgr.save(400, 1.0, unverified_reason="a guard alarm since step 398 (the test's)")
    manifest = read_manifest(root / "step_00000398")
    for step in range(400 - 2 * (MANY - 1), 398, 2):
        (root / checkpoint_id(step) / MANIFEST).write_text(replace(manifest, checkpoint_id=checkpoint_id(step),
                                                                   step=step).to_json())
    assert len(list_committed(root, include_bad=True)) == MANY
    return root


def resume_and_roll_back(s3, root: Loc, out, delay_s: float, timeout_s: float):
    """tests/support/workers/s3_rollback_ranks.py on 2 ranks: resume=auto, then a rollback from step 401, with
    every request to the server held ``delay_s`` and collectives timing out after ``timeout_s``; the finished
    process and each rank's record ({} for a rank that wrote none)."""
    import json

    from support.launch import run, subprocess_env, torchrun, worker

    out.mkdir(exist_ok=True)
    s3.delay_requests(delay_s)
    try:
        proc = run(torchrun(2, worker("s3_rollback_ranks")), timeout=600, env=subprocess_env(
            {**s3.env, "CKPT_ROOT": str(root), "COLLECTIVE_TIMEOUT_S": str(timeout_s), "ROLLBACK_FROM": "401",
             "OUT_DIR": str(out)}))
    finally:
        s3.delay_requests(0)
    return proc, [json.loads(p.read_text()) if p.is_file() else {} for p in (out / "rank0.json", out / "rank1.json")]


@pytest.mark.distributed
def test_a_resume_and_a_rollback_over_100_checkpoints_on_a_slow_store_stay_within_the_collective_timeout(
        s3, tmp_path):
    """100 committed checkpoints on a store that takes 100 ms for every request, 2 ranks whose collectives time
    out after 10 s: a resume (resume=auto) and a rollback (from step 401 to the verified step 398, superseding
    step 400, saving step 398 again) complete. Rank 0 lists and reads for every rank while the others agree
    every few seconds that it is still at it, and each decision lists checkpoint.dir once, reading each
    manifest and marker with one request."""
    root = _many_checkpoints("many")
    proc, (rank0, rank1) = resume_and_roll_back(s3, root, tmp_path / "out", delay_s=0.1, timeout_s=10)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert (rank0["resumed_step"], rank0["rolled_back_to"]) == (400, 398) == (rank1["resumed_step"],
                                                                             rank1["rolled_back_to"])
    assert _trusted(root)[:2] == [398, 396] and committed_dir(root, 398).name == "step_00000398.r1"
    for phase in ("start", "resume", "rollback"):  # one listing each (start: the pre-flight's), a request per file
        made = sum(rank0["requests"][phase].values())
        assert made < 5 * MANY, (phase, rank0["requests"][phase])
