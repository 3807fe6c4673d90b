"""checkpoint/durable/ raw.py, reader.py: raw-bytes tensors read straight into their
destinations, checksums computed while writing and verified while reading, stock DCP checkpoints still readable."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from checkpoint.durable import reader as reader_module
from checkpoint.durable.manifest import CheckpointError, FileEntry, checksum_file
from checkpoint.durable.raw import RawFileWriter
from checkpoint.durable.reader import RawFileReader
from checkpoint.durable.saver import acknowledge
from support.launch import run, torchrun, worker


@pytest.fixture(autouse=True)
def _quick_reread(monkeypatch):
    """Damage found while loading is read again after REREAD_DELAY_S (1 s: a network file system's
    cache); the second read still happens here, after 10 ms, since the wait is not what these tests check."""
    monkeypatch.setattr(reader_module, "REREAD_DELAY_S", 0.01)


def sample_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(17.0),  # 0-dim, like AdamW's step
        "ids": torch.arange(10, dtype=torch.int64) * (1 << 40),
        "mask": torch.rand(9, generator=g) > 0.5,
        "extra": {"epoch": 3, "names": ["a", "b"]},  # pickled (BYTE_IO)
    }


def zeroed(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0, "names": []}
            for k, v in sd.items()}


def save_raw(path, sd, algorithm="xxh3_64") -> RawFileWriter:
    writer = RawFileWriter(path, algorithm)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return writer


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_round_trip_is_bitwise_and_the_writer_checksum_is_the_files(tmp_path, streams):
    sd = sample_state()
    writer = save_raw(tmp_path, sd)
    (name, entry), = writer.written.items()
    assert entry.size == (tmp_path / name).stat().st_size
    assert entry.checksum == checksum_file(tmp_path / name, "xxh3_64")
    # each tensor is exactly its bytes (no torch.save archive around it), items back to back
    spans = {k.fqn: v for k, v in FileSystemReader(str(tmp_path)).read_metadata().storage_data.items()}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert spans[k].length == v.numel() * v.element_size(), k
    assert sum(s.length for s in spans.values()) == entry.size
    got = zeroed(sd)
    reader = RawFileReader(tmp_path, verify={name: entry}, algorithm="xxh3_64", threads=streams)
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert reader.problems == []
    assert_equal(got, sd)


def test_tensors_land_in_the_destinations_own_memory(tmp_path):
    sd = {"w": torch.randn(128, 16)}
    save_raw(tmp_path, sd)
    dest = torch.zeros(128, 16)
    ptr = dest.data_ptr()
    out = {"w": dest}
    dcp.load(out, storage_reader=RawFileReader(tmp_path), no_dist=True)
    assert out["w"].data_ptr() == ptr and torch.equal(dest, sd["w"])


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("where", ["tensor", "pickled"])
def test_a_flipped_bit_is_found_while_loading_and_nothing_is_unpickled(tmp_path, where, streams):
    sd = sample_state()
    writer = save_raw(tmp_path, sd)
    (name, entry), = writer.written.items()
    meta = FileSystemReader(str(tmp_path)).read_metadata()
    fqn = "w" if where == "tensor" else "extra.names"
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    data = bytearray((tmp_path / name).read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    (tmp_path / name).write_bytes(data)
    got = zeroed(sd)
    reader = RawFileReader(tmp_path, verify={name: entry}, algorithm="xxh3_64", threads=streams)
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert len(reader.problems) == 1 and "xxh3_64 checksum" in reader.problems[0] and name in reader.problems[0]
    assert got["extra"] == {"epoch": 0, "names": []}  # never unpickled from a file that failed


@pytest.mark.parametrize("streams, gap_limit, scratch", [(1, 64 << 20, 16 << 20), (2, 64 << 20, 16 << 20),
                                                        (2, 0, 256)])
def test_bytes_this_rank_does_not_need_are_still_verified(tmp_path, monkeypatch, streams, gap_limit, scratch):
    """Loading a subset leaves gaps in the file: they are read and hashed too, by parallel
    streams into fresh buffers, or (past GAP_LIMIT) by one stream through two recycled ones."""
    monkeypatch.setattr(reader_module, "GAP_LIMIT", gap_limit)
    monkeypatch.setattr(reader_module, "SCRATCH", scratch)
    sd = sample_state()
    writer = save_raw(tmp_path, sd)
    (name, entry), = writer.written.items()
    subset = {"half": torch.zeros_like(sd["half"]), "step": torch.tensor(0.0)}
    reader = RawFileReader(tmp_path, verify={name: entry}, algorithm="xxh3_64", threads=streams)
    dcp.load(subset, storage_reader=reader, no_dist=True)
    assert reader.problems == []
    assert torch.equal(subset["half"], sd["half"]) and subset["step"].item() == 17.0
    # a flipped bit inside a tensor nobody loaded is still found
    info = next(v for k, v in FileSystemReader(str(tmp_path)).read_metadata().storage_data.items() if k.fqn == "w")
    data = bytearray((tmp_path / name).read_bytes())
    data[info.offset + 7] ^= 1
    (tmp_path / name).write_bytes(data)
    reader = RawFileReader(tmp_path, verify={name: entry}, algorithm="xxh3_64", threads=streams)
    dcp.load({"half": torch.zeros_like(sd["half"])}, storage_reader=reader, no_dist=True)
    assert len(reader.problems) == 1 and "checksum" in reader.problems[0]


def test_a_truncated_file_is_reported_not_misread(tmp_path):
    sd = sample_state()
    writer = save_raw(tmp_path, sd)
    (name, entry), = writer.written.items()
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[: entry.size // 2])
    for verify in ({name: entry}, None):
        reader = RawFileReader(tmp_path, verify=verify, algorithm="xxh3_64")
        dcp.load(zeroed(sd), storage_reader=reader, no_dist=True)
        assert any("truncated" in p for p in reader.problems), reader.problems


def test_stock_dcp_refuses_raw_files_instead_of_misreading_them(tmp_path):
    sd = {"w": torch.randn(4, 4)}
    save_raw(tmp_path, sd)
    with pytest.raises(BaseException, match="Unknown extension"):  # DCP wraps it in CheckpointException
        dcp.load({"w": torch.zeros(4, 4)}, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)


def test_checkpoints_written_by_stock_dcp_still_load(tmp_path):
    sd = sample_state()
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    got = zeroed(sd)
    dcp.load(got, storage_reader=RawFileReader(tmp_path), no_dist=True)
    assert_equal(got, sd)


def test_acknowledge_uses_the_writers_checksum_and_refuses_a_file_that_changed(tmp_path):
    writer = save_raw(tmp_path, sample_state(), algorithm="crc32")
    (name, entry), = writer.written.items()
    assert acknowledge(tmp_path, 0, "crc32", known=writer.written) == {name: entry}
    with open(tmp_path / name, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match="bytes in storage after its writer wrote"):
        acknowledge(tmp_path, 0, "crc32", known=writer.written)
    # without the writer's record, the file is read back
    entries = acknowledge(tmp_path, 0, "crc32")
    assert entries[name] == FileEntry(entry.size + 1, checksum_file(tmp_path / name, "crc32"))


@pytest.mark.distributed
def test_chunks_reshard_bitwise_across_layouts(tmp_path):
    """Row-sharded reads go straight into the shard; column blocks go through a copy. Then, at 2 ranks,
    plan caching: two saves of the same structure through CheckpointSaver plan once (one global plan on
    the coordinator, an empty local plan the second time) and the second holds its own values
    (tests/support/workers/storage_worker.py)."""
    proc = run(torchrun(2, worker("storage_worker"), str(tmp_path)), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_a_later_save_of_the_same_structure_reuses_the_plan_and_the_data_is_new(tmp_path, monkeypatch):
    """Plan caching (checkpoint/durable/saver.py): the coordinator plans the first save only; the
    second save of a state with the same structure reuses the global plan and metadata, and still
    writes the second save's values."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    from checkpoint.durable.discovery import committed_dir
    from checkpoint.durable.manifest import Manifest
    from checkpoint.durable.saver import CheckpointSaver

    for cache in ("_cached_all_plans", "_cached_global_plan", "_cached_metadata", "_cached_save_plan",
                  "_cached_final_save_plan"):
        monkeypatch.setattr(SavePlanner, cache, {})  # class-level caches: this test starts with none
    planned = []
    plan = DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", lambda self, p: planned.append(1) or plan(self, p))
    saver = CheckpointSaver(tmp_path, "sync", 0, 1)
    for step in (1, 2):
        state = {"model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3.0) * step}}
        saver.save(state, Manifest(f"step_{step:08d}", step, 0, 0, 0.0, "h", {}, 1, {}, 1, None, None, None))
    assert planned == [1]  # the second save reused the first one's plan
    loaded = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    dcp.load(loaded, storage_reader=RawFileReader(committed_dir(tmp_path, 2)), no_dist=True)
    assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 2.0)) and torch.equal(loaded["model"]["b"],
                                                                                      torch.arange(3.0) * 2)
