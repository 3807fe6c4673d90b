"""The commit protocol, discovery, manifest checks, staging, config hash and preflight, in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoint.durable.discovery import (
    checkpoint_dir,
    clean_uncommitted,
    committed_dir,
    fresh_dir,
    latest_committed,
    list_checkpoints,
    list_committed,
    mark_bad,
    read_latest_pointer,
    resolve_resume,
)
from checkpoint.durable.manifest import CheckpointError, FileEntry, Manifest, verify_checkpoint
from checkpoint.durable.saver import (
    CommitTimeout,
    acknowledge,
    collect_acknowledgements,
    commit_checkpoint,
    update_latest,
)
from support.launch import load_script


def manifest_for(step, files):
    return Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "hash", {"seed": 1}, 2, {"dp_shard": 2}, 8, 1.0, 1.1,
                    "crc32", files)


def write_rank_files(d, rank, payload=b"abc"):
    d.mkdir(parents=True, exist_ok=True)
    (d / f"__{rank}_0.distcp").write_bytes(payload * 1000)


def full_commit(root, step, world=2):
    d = fresh_dir(root, step)
    for r in range(world):
        write_rank_files(d, r, payload=bytes([r + step % 200]) * 3)
        acknowledge(d, r, "crc32")
    (d / ".metadata").write_bytes(b"meta")
    files = collect_acknowledgements(d, world, timeout_s=1)
    files[".metadata"] = FileEntry(4, None)
    final = commit_checkpoint(d, manifest_for(step, files))
    update_latest(root, final.name)
    return final


def test_commit_makes_a_verifiable_checkpoint_and_moves_latest(tmp_path):
    full_commit(tmp_path, 10)
    final = full_commit(tmp_path, 20)
    assert read_latest_pointer(tmp_path) == "step_00000020"
    assert [c.step for c in list_committed(tmp_path)] == [20, 10]
    m = verify_checkpoint(final)
    assert m.step == 20 and set(m.files) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}


def test_a_missing_acknowledgement_leaves_the_checkpoint_uncommitted(tmp_path):
    full_commit(tmp_path, 10)
    d = checkpoint_dir(tmp_path, 20)
    write_rank_files(d, 0)
    acknowledge(d, 0, "crc32")  # rank 1 never finishes
    with pytest.raises(CommitTimeout, match=r"ranks \[1\] did not acknowledge"):
        collect_acknowledgements(d, 2, timeout_s=0.2)
    assert latest_committed(tmp_path).step == 10
    assert resolve_resume(tmp_path, "auto") == committed_dir(tmp_path, 10)


def test_unacknowledged_files_and_a_second_commit_are_refused(tmp_path):
    d = checkpoint_dir(tmp_path, 5)
    write_rank_files(d, 0)
    acknowledge(d, 0, "crc32")
    write_rank_files(d, 1)  # a file no acknowledgement lists (another attempt's rank)
    with pytest.raises(CheckpointError, match=r"without an acknowledgement: \['__1_0.distcp'\]"):
        collect_acknowledgements(d, 1, timeout_s=1)
    first = manifest_for(5, {"__0_0.distcp": FileEntry(3000, None)})
    commit_checkpoint(d, first)
    with pytest.raises(CheckpointError, match="a manifest exists already") as refused:  # the create is exclusive
        commit_checkpoint(d, manifest_for(5, {}))
    assert isinstance(refused.value.__cause__, FileExistsError)
    assert verify_checkpoint(d, checksums=False).files == first.files  # the first commit stands


def test_discovery_ignores_and_cleans_uncommitted(tmp_path):
    full_commit(tmp_path, 10)
    write_rank_files(checkpoint_dir(tmp_path, 20), 0)  # a save a crash interrupted before its manifest
    (tmp_path / "step_00000030").mkdir()
    assert [c.step for c in list_committed(tmp_path)] == [10]
    assert {c.checkpoint_id: c.committed for c in list_checkpoints(tmp_path)} == {
        "step_00000030": False, "step_00000020": False, "step_00000010": True}
    assert sorted(clean_uncommitted(tmp_path)) == ["step_00000020", "step_00000030"]
    assert not checkpoint_dir(tmp_path, 20).exists() and committed_dir(tmp_path, 10).is_dir()


def test_corruption_is_detected(tmp_path):
    final = full_commit(tmp_path, 10)
    victim = final / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0.distcp: crc32 .* manifest says"):
        verify_checkpoint(final)
    victim.write_bytes(b"short")
    with pytest.raises(CheckpointError, match="5 bytes, manifest says 3000"):
        verify_checkpoint(final)


def test_resolve_resume_specs(tmp_path):
    assert resolve_resume(tmp_path, "auto") is None
    assert resolve_resume(tmp_path, "never") is None
    with pytest.raises(CheckpointError, match="resume=must but .* no usable committed checkpoint"):
        resolve_resume(tmp_path, "must")
    full_commit(tmp_path, 10)
    full_commit(tmp_path, 20)
    assert resolve_resume(tmp_path, "must") == committed_dir(tmp_path, 20)
    assert resolve_resume(tmp_path, "10") == committed_dir(tmp_path, 10)
    assert resolve_resume(tmp_path, str(committed_dir(tmp_path, 10))) == committed_dir(tmp_path, 10)
    with pytest.raises(CheckpointError, match=r"committed steps: \[20, 10\]"):
        resolve_resume(tmp_path, "15")
    mark_bad(committed_dir(tmp_path, 20), "probe loss 3.1 != 2.9")
    assert resolve_resume(tmp_path, "auto") == committed_dir(tmp_path, 10)
    assert [c.bad for c in list_checkpoints(tmp_path)][0] == "probe loss 3.1 != 2.9"


def test_a_resave_of_a_committed_step_goes_beside_it_and_replaces_it(tmp_path):
    first = full_commit(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in Path(first).rglob("*") if p.is_file()}
    second = full_commit(tmp_path, 10)
    assert second.name == "step_00000010.r1" and read_latest_pointer(tmp_path) == "step_00000010.r1"
    assert {p.name: p.read_bytes() for p in Path(first).rglob("*") if p.is_file()} == before  # untouched
    assert [c.path for c in list_committed(tmp_path)] == [second]  # the newest save of the step
    assert [c.checkpoint_id for c in list_checkpoints(tmp_path) if c.replaced] == ["step_00000010"]
    assert resolve_resume(tmp_path, "10") == second and committed_dir(tmp_path, 10) == second


def test_a_create_whose_link_was_made_but_answered_eexist_is_this_writers_own(tmp_path, monkeypatch):
    """An NFS client retransmits a LINK whose answer was lost and the server answers the retransmission
    EEXIST, though the first made the link: the name is this writer's file (the same inode), the create
    succeeded. A name another writer created stays refused."""
    import errno

    from checkpoint.storage import location

    real_link = os.link

    def link_then_eexist(src, dst):
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    record = location(str(tmp_path / "attempt_000001"))
    monkeypatch.setattr(os, "link", link_then_eexist)
    record.create_bytes(b"this writer's record")
    monkeypatch.undo()
    assert record.read_bytes() == b"this writer's record" and os.listdir(tmp_path) == ["attempt_000001"]
    with pytest.raises(FileExistsError):
        record.create_bytes(b"another writer's record")
    assert record.read_bytes() == b"this writer's record" and os.listdir(tmp_path) == ["attempt_000001"]


def test_host_stager_reuses_buffers_and_never_aliases_live_tensors():
    from checkpoint.durable.saver import HostStager

    live = {"model": {"w": torch.randn(4, 3)}, "optim": {"step": torch.tensor(3.0)}, "blob": b"abc"}
    stager = HostStager(pin_memory=False)
    first = stager.stage(live)
    assert torch.equal(first["model"]["w"], live["model"]["w"])
    assert first["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()
    live["model"]["w"].add_(1.0)
    assert not torch.equal(first["model"]["w"], live["model"]["w"])  # a snapshot, not a view
    second = stager.stage(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # buffers reused
    assert torch.equal(second["model"]["w"], live["model"]["w"]) and second["blob"] == b"abc"
    assert stager.rebuilds == 1


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def test_host_staging_is_one_allocation_of_the_states_bytes(monkeypatch):
    """Pinned staging is bounded by the state: CUDA's caching host allocator rounds each pinned allocation up to
    a power of two and keeps it, so one buffer per tensor pins up to 2x the state. The stager allocates one
    buffer (views into it), and pins it by registering its pages: the bytes registered are the state's bytes
    plus alignment. (CPU: the registration is recorded, not made; on a GPU, not verified here.)"""
    from checkpoint.durable import staging
    from checkpoint.durable.saver import HostStager
    from model.config import ModelConfig
    from model.llama import build_model

    model = build_model(ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                                    max_seq_len=32), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    live = {"model": model.state_dict(), "optim": opt.state_dict()}
    tensors = [t for t in [*live["model"].values(), *(v for s in opt.state.values() for v in s.values())]]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    registered = []
    monkeypatch.setattr(staging, "_register", lambda buf: registered.append(buf.numel()))  # CUDA: cudaHostRegister
    stager = HostStager(pin_memory=True)
    staged = stager.stage(live)
    flat = [*staged["model"].values(), *(v for s in staged["optim"]["state"].values() for v in s.values())]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat}
    assert len(storages) == 1, (f"{len(storages)} staging allocations for {len(flat)} tensors: with power-of-two "
                                f"rounding they would pin {sum(map(_pow2, storages.values())) / state_bytes:.2f}x "
                                "the state")
    assert registered == list(storages.values())  # the one buffer, pinned once
    assert state_bytes <= registered[0] < state_bytes + staging.ALIGN * len(flat)
    assert all(torch.equal(a, b) for a, b in zip(flat, tensors))
    assert stager.stage(live) is not None and len(registered) == 1  # reused, not pinned again


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_registered_shared_and_not_moved_by_the_send():
    """On a GPU (not run here): async_process's staging buffer is page-locked by registration (CUDA's caching
    host allocator allocates nothing for it), in shared memory, holds the device's values, and pickling it as
    DCP's send to the writer process does moves nothing."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - torch's reductions for the pickling, as DCP's pipe has them

    from checkpoint.durable.saver import HostStager

    live = {"w": torch.randn(1000, 1000, device="cuda"), "b": torch.randn(333, device="cuda").to(torch.bfloat16),
            "step": torch.tensor(1.0)}
    pinned_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    stager = HostStager(pin_memory=True, share_memory=True)
    staged = stager.stage(live)
    assert stager.buffer.is_pinned() and stager.buffer.is_shared()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == pinned_before
    assert all(torch.equal(staged[k].cpu(), v.cpu()) for k, v in live.items())
    ptrs = {k: v.data_ptr() for k, v in staged.items()}
    ForkingPickler.dumps(staged)
    assert {k: v.data_ptr() for k, v in stager.stage(live).items()} == ptrs and stager.buffer.is_pinned()
    stager.close()


def test_config_hash_ignores_resume_mutable_fields_and_names_changes():
    from omegaconf import OmegaConf

    from checkpoint.state.fingerprint import config_differences, config_hash, hashed_config

    plain = OmegaConf.to_container  # the resolved config as plain data, as a manifest records it
    cfg = OmegaConf.create({"seed": 1, "optim": {"lr": 0.1, "beta2": 0.95}, "parallel": {"tp": 1}, "run_name": "a",
                            "training": {"micro_batch_size": 4, "global_batch_size": 8, "steps": 10},
                            "data": {"num_workers": 0, "path": "x"}, "checkpoint": {"interval": 5}})
    moved = OmegaConf.merge(cfg, {"parallel": {"tp": 2}, "run_name": "b", "data": {"num_workers": 4},
                                  "training": {"micro_batch_size": 2, "steps": 20},  # the schedule may change too
                                  "checkpoint": {"interval": 50}, "optim": {"lr": 0.2}})
    assert config_hash(hashed_config(plain(cfg))) == config_hash(hashed_config(plain(moved)))
    changed = OmegaConf.merge(cfg, {"optim": {"beta2": 0.99}, "training": {"global_batch_size": 16}})
    assert config_hash(hashed_config(plain(cfg))) != config_hash(hashed_config(plain(changed)))
    assert config_differences(hashed_config(plain(cfg)), hashed_config(plain(changed))) == [
        "optim.beta2: 0.95 -> 0.99", "training.global_batch_size: 8 -> 16"]


def test_preflight_checks_directory_and_space(tmp_path):
    from checkpoint.durable.preflight import PreflightError, preflight_checkpoint_dir

    preflight_checkpoint_dir(tmp_path / "new" / "dir", expected_bytes=1 << 20, keep_last=2, rank=0)
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreflightError, match=f"{tmp_path / 'file'} is a regular file, not a folder"):
        preflight_checkpoint_dir(tmp_path / "file" / "ckpt", expected_bytes=1, keep_last=1, rank=0)
    with pytest.raises(PreflightError, match="free, counting leftovers of interrupted saves, but this run needs"):
        preflight_checkpoint_dir(tmp_path, expected_bytes=1 << 60, keep_last=1, rank=0)


@pytest.mark.parametrize("mode", ["async_process", "async"])
def test_the_preflight_counts_the_shared_memory_async_process_stages_in(tmp_path, monkeypatch, mode):
    """async_process stages each rank's state in shared memory (/dev/shm; checkpoint/durable/staging.py): a
    container's small /dev/shm (a 1 MiB tmpfs here) stops the run before step 1, naming the bytes, instead of a
    SIGBUS at the first save. The writer thread (async) stages in ordinary memory and is not stopped."""
    from omegaconf import OmegaConf

    from checkpoint.durable import preflight
    from checkpoint.durable.preflight import PreflightError, expected_checkpoint_bytes
    from checkpoint.state.training_state import TrainingState
    from model.llama import build_model
    from parallel.dims import ParallelDims
    from support.config import compose_debug
    from support.tmpfs import tmpfs
    from trainer.config import typed
    from trainer.preflight import claim_lease
    from trainer.run import checkpoint_manager
    from training.optimizer import build_optimizer
    from training.schedule import build_scheduler

    cfg = compose_debug(f"output_root={tmp_path}", "run_name=shm", "checkpoint.interval=2",
                        f"checkpoint.async_mode={mode}")
    model = build_model(OmegaConf.to_object(cfg.model), seed=0)
    optimizer = build_optimizer(model, cfg.optim)
    state = TrainingState(model, optimizer, build_scheduler(optimizer, cfg.optim, cfg.training.steps),
                          optim_config=cfg.optim)
    rank_bytes = expected_checkpoint_bytes(model, local=True)  # model and two moments: what a rank stages
    assert rank_bytes > 1 << 20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of this node stage there
    with tmpfs(tmp_path / "dev_shm", 1) as shm:
        monkeypatch.setattr(preflight, "SHM", shm)
        ckpt = checkpoint_manager(typed(cfg)[0], state, 0, 1, ParallelDims(1, 1, 1, 1).layout, torch.device("cpu"))
        try:
            if mode == "async":
                ckpt.preflight(claim_lease(cfg.checkpoint))
                return
            with pytest.raises(PreflightError) as err:
                ckpt.preflight(claim_lease(cfg.checkpoint))
        finally:
            ckpt.close()
    message = str(err.value)
    assert f"2 ranks on this node x {rank_bytes:,} bytes = {2 * rank_bytes:,} bytes" in message
    assert f"{shm} has 1,048,576 bytes (0.001 GiB) free" in message
    for fix in ("--shm-size", "remount,size=", "checkpoint.async_mode=async"):
        assert fix in message


def test_a_ranks_own_bytes_under_hsdp_are_its_shards_not_the_global_size_over_the_world():
    """What a rank stages (and snapshots) is its own shards: with dp_replicate 2 x dp_shard 2 every rank holds
    half the model, twice the global size over the 4 ranks the pre-flights divided by before (rank 0 of a
    fake process group, nothing allocated)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint.durable.preflight import expected_checkpoint_bytes
    from model.llama import build_model
    from parallel.config import ParallelConfig
    from parallel.dims import ParallelDims
    from parallel.parallelize import parallelize_model
    from support.config import compose_debug

    mcfg = OmegaConf.to_object(compose_debug().model)
    model = build_model(mcfg, materialize=False)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1, world_size=4)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        parallelize_model(model, dims, ParallelConfig(dp_replicate=2, dp_shard=2, tp=1, device="cpu"),
                          torch.device("cpu"), seq_len=16)
        global_bytes = expected_checkpoint_bytes(model)
        shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        assert expected_checkpoint_bytes(model, local=True) == 3 * shards
        assert 3 * shards >= global_bytes // 2 > global_bytes // 4
    finally:
        dist.destroy_process_group()


def test_checksum_algorithms_agree_with_reference_implementations(tmp_path):
    import zlib

    from checkpoint.durable.manifest import CHUNK, checksum_file

    data = os.urandom(CHUNK + 12345)  # spans two read chunks
    (tmp_path / "f").write_bytes(data)
    assert checksum_file(tmp_path / "f", "crc32") == f"{zlib.crc32(data):08x}"
    xxhash = pytest.importorskip("xxhash")
    assert checksum_file(tmp_path / "f", "xxh3_64") == xxhash.xxh3_64(data).hexdigest()


def test_inspect_lists_state_tier_and_verification(tmp_path):
    rows = load_script("inspect_checkpoints").rows

    for step in (10, 20, 30):
        full_commit(tmp_path, step)
    write_rank_files(checkpoint_dir(tmp_path, 40), 0)
    (committed_dir(tmp_path, 10) / "__0_0.distcp").write_bytes(b"garbage")
    mark_bad(committed_dir(tmp_path, 20), "probe loss mismatch")
    table = {r["checkpoint_id"]: r for r in rows(tmp_path, verify=True, keep_last=1, keep_every=0,
                                                 keep_best=0, best_metric="loss")}
    assert table["step_00000040"]["state"] == "uncommitted"
    assert table["step_00000030"]["state"] == "committed" and table["step_00000030"]["tier"] == "rolling"
    assert table["step_00000030"]["verified"] == "ok"
    assert table["step_00000020"]["state"] == "bad"
    assert table["step_00000010"]["tier"] == "delete-next"
    assert table["step_00000010"]["verified"].startswith("FAILED: __0_0.distcp: 7 bytes")
