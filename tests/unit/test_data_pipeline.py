"""The per-rank pipeline: dp-independent global batches, O(1) exact resume, refusals."""

import gc
import logging
import os
import pickle

import numpy as np
import pytest
import torch

from data.batching import make_batch_plan, rank_micro_batches
from data.formats.native import TokenFile
from data.state import DataResumeError
from support.data import assert_same_batches, data_config, global_batches, pipeline
from support.launch import ROOT
from training.step import IGNORE_INDEX

STEPS = 12


@pytest.fixture(scope="module")
def reference(pydoc_data):
    """The uninterrupted run: dp=1, loading in the training process."""
    return global_batches(data_config(pydoc_data), dp=1, steps=STEPS)


class _CollectsAutomatically(torch.utils.data.Dataset):
    """Each item: whether the process that loads it collects its garbage automatically."""

    def __getitem__(self, index):
        return gc.isenabled()


def test_loader_workers_collect_their_garbage_while_the_trainer_does_not(pydoc_data, monkeypatch):
    """The training process turns automatic collection off (trainer/run.py: training.gc_interval);
    a loader worker collects automatically (its pauses hold up no collective)."""
    pipe = pipeline(data_config(pydoc_data, num_workers=1), dp=1, rank=0)
    monkeypatch.setattr(pipe, "dataset", _CollectsAutomatically())
    gc.disable()
    try:
        assert next(iter(pipe._loader(0))) is True
    finally:
        gc.enable()


@pytest.mark.parametrize("dp", [2, 4])
def test_global_batches_identical_for_every_dp_size(pydoc_data, reference, dp):
    # global 8, micro 2: dp=1 -> accum 4, dp=2 -> accum 2, dp=4 -> accum 1
    assert_same_batches(global_batches(data_config(pydoc_data), dp=dp, steps=STEPS), reference)


def test_rank_slices_tile_the_global_batch_for_every_divisor():
    for dp in (1, 2, 3, 4, 6, 12):
        for micro in (m for m in range(1, 13) if (12 // dp) % m == 0 and 12 % dp == 0):
            plan = make_batch_plan(12, micro, dp)
            covered = [i for r in range(dp) for s in rank_micro_batches(plan, 120, r)
                       for i in range(s.start, s.start + s.count)]
            assert covered == list(range(120, 132)), (dp, micro)


def test_replica_groups_read_the_global_batches_whatever_the_quorum(pydoc_data, reference):
    """parallel.fault_tolerance: two one-rank groups share each global batch between the groups of the step's
    quorum (set_split); while group 1 is out group 0 reads all of it, and group 1 rejoins from group 0's data
    state (what a peer's state hands it): every step's batch is the uninterrupted run's
    (recovery/fault_tolerance.py)."""
    quorum = [2, 2, 1, 1, 1, 2, 2, 1, 2, 2, 2, 2]  # groups in each step's quorum (group 1 out when 1)
    groups = [pipeline(data_config(pydoc_data), dp=1, rank=0) for _ in range(2)]
    rows = []
    for step, n in enumerate(quorum):
        if n == 2 and groups[1].step != step:  # rejoining: the live group's position
            groups[1].load_state_dict(groups[0].state_dict())
        parts = []
        for index in range(n):
            groups[index].set_split(make_batch_plan(8, 2, n), index)
            ids = np.concatenate(groups[index].upcoming_sample_ids())
            micro = groups[index].next_micro_batches(step)
            parts.append((ids, torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])))
        rows.append(tuple(np.concatenate([p[0] for p in parts]) if i == 0 else torch.cat([p[i] for p in parts])
                          for i in range(3)))
    for pipe in groups:
        pipe.close()
    assert_same_batches(rows, reference)


def test_resume_is_exact_across_num_workers_and_dp(pydoc_data, reference):
    """Saved at step 5 by two ranks with 2 workers each; resumed at dp 1/2/4, 0 or 3 workers."""
    saved_at = 5
    states = []
    for rank in range(2):
        pipe = pipeline(data_config(pydoc_data, num_workers=2), dp=2, rank=rank)
        for step in range(saved_at):
            pipe.next_micro_batches(step)
        states.append(pipe.state_dict())
        pipe.close()
    assert states[0] == states[1], "the data state must be identical on every rank"
    state = states[0]
    assert state["step"] == saved_at and state["samples_consumed"] == saved_at * 8
    assert all(isinstance(v, (int, str)) for v in state.values())
    for dp, workers in [(1, 0), (1, 3), (2, 0), (2, 3), (4, 0), (4, 3)]:
        resumed = global_batches(data_config(pydoc_data, num_workers=workers), dp=dp,
                                 steps=STEPS - saved_at, state=state)
        assert_same_batches(resumed, reference[saved_at:])


def test_resume_far_into_training_needs_no_replay(pydoc_data):
    """Step 10^7 (many epochs in): the state is a number, the batch the pure order's."""
    far = {**pipeline(data_config(pydoc_data), dp=1, rank=0).state_dict(),
           "step": 10 ** 7, "samples_consumed": 8 * 10 ** 7}
    pipe = pipeline(data_config(pydoc_data), dp=2, rank=1)
    pipe.load_state_dict(far)
    ids = np.concatenate(pipe.upcoming_sample_ids())
    np.testing.assert_array_equal(ids, pipe.order.sequence_ids(np.arange(8 * 10 ** 7 + 4, 8 * 10 ** 7 + 8)))
    inputs = torch.cat([x for x, _ in pipe.next_micro_batches(10 ** 7)])
    assert torch.equal(inputs, torch.from_numpy(pipe.order.read(np.arange(8 * 10 ** 7 + 4, 8 * 10 ** 7 + 8)))[:, :-1])
    assert pipe.state_dict()["epoch"] == (8 * 10 ** 7 + 8) // pipe.order.sources[0].num_sequences


@pytest.mark.parametrize("change, field", [
    (dict(seed=99), "seed"), (dict(seq_len=16), "seq_len"), (dict(global_batch=16), "global_batch_size"),
])
def test_resume_with_a_different_meaning_is_refused(pydoc_data, change, field):
    state = pipeline(data_config(pydoc_data), dp=1, rank=0).state_dict()
    other = pipeline(data_config(pydoc_data), dp=1, rank=0, **change)
    with pytest.raises(DataResumeError, match=rf"refusing to resume.*{field}: checkpoint .* -> this run .*"
                                              r"data.allow_resume_changes=true"):
        other.load_state_dict(state)


def test_resume_on_other_data_is_refused_unless_allowed(pydoc_data, tmp_path, caplog):
    from data.prep.writer import prepare_token_file

    (tmp_path / "other.txt").write_text("some other corpus entirely. " * 400)
    prepare_token_file(tmp_path / "other", [str(tmp_path / "other.txt")], "byte")
    pipe = pipeline(data_config(pydoc_data), dp=1, rank=0)
    for step in range(3):
        pipe.next_micro_batches(step)
    state = pipe.state_dict()
    with pytest.raises(DataResumeError, match=r"fingerprint: checkpoint '[0-9a-f]{64}' -> this run '[0-9a-f]{64}'"):
        pipeline(data_config(tmp_path / "other"), dp=1, rank=0).load_state_dict(state)
    allowed = pipeline(data_config(tmp_path / "other", allow_resume_changes=True), dp=1, rank=0, seed=5)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        allowed.load_state_dict(state)
    assert "fingerprint: checkpoint" in caplog.text and "seed: checkpoint 1234 -> this run 5" in caplog.text
    assert "of a different sample order" in caplog.text
    assert allowed.step == 3 and allowed.samples_consumed == 24
    allowed.next_micro_batches(3)


def test_a_changed_global_batch_continues_from_the_next_sample_when_allowed(pydoc_data, reference):
    pipe = pipeline(data_config(pydoc_data), dp=1, rank=0)
    for step in range(3):
        pipe.next_micro_batches(step)
    bigger = pipeline(data_config(pydoc_data), dp=2, rank=0, global_batch=16, allow_global_batch_change=True)
    bigger.load_state_dict(pipe.state_dict())
    with pytest.raises(DataResumeError, match=r"Changed: seed: checkpoint 1234 -> this run 9\."):
        pipeline(data_config(pydoc_data), dp=1, rank=0, seed=9, global_batch=16,
                 allow_global_batch_change=True).load_state_dict(pipe.state_dict())
    ids = np.concatenate(bigger.upcoming_sample_ids())  # rank 0 of dp 2: the first 8 of 16
    np.testing.assert_array_equal(ids, reference[3][0])  # = the old run's step 3: nothing skipped


def test_asking_for_the_wrong_step_fails_loudly(pydoc_data):
    pipe = pipeline(data_config(pydoc_data), dp=1, rank=0)
    with pytest.raises(RuntimeError, match=r"asks for step 7, but the data pipeline is at step 0 .*load_state_dict"):
        pipe.next_micro_batches(7)


def test_state_round_trips_through_distributed_checkpoint(pydoc_data, tmp_path):
    import torch.distributed.checkpoint as dcp

    pipe = pipeline(data_config(pydoc_data), dp=1, rank=0)
    for step in range(4):
        pipe.next_micro_batches(step)
    dcp.save({"data": pipe}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = pipeline(data_config(pydoc_data, num_workers=1), dp=4, rank=3)
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert fresh.state_dict() == pipe.state_dict()
    assert fresh.next_micro_batches(4)[0][0].shape == (2, 32)


def test_targets_after_eos_are_ignored_when_loss_must_not_cross_documents(pydoc_data):
    eos = TokenFile(pydoc_data).meta.eos_id

    def first_steps(cross: bool):
        pipe = pipeline(data_config(pydoc_data, cross_document_loss=cross), dp=1, rank=0, global_batch=32,
                        micro=32, seq_len=256)
        micro = [m for step in range(4) for m in pipe.next_micro_batches(step)]
        return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])

    x, y_cross = first_steps(True)
    x_masked, y_masked = first_steps(False)
    at_eos = x == eos
    assert torch.equal(x, x_masked)
    assert at_eos.sum() > 0, "expected document boundaries in 128 x 256 bytes of pydoc topics"
    assert (y_masked[at_eos] == IGNORE_INDEX).all()
    assert torch.equal(y_masked[~at_eos], y_cross[~at_eos])
    assert (y_cross != IGNORE_INDEX).all()


def test_token_files_pickle_without_their_tokens(pydoc_data):
    tf = TokenFile(pydoc_data)
    blob = pickle.dumps(tf)
    assert len(blob) < 4096 < tf.tokens.nbytes
    assert np.array_equal(pickle.loads(blob).tokens[:100], tf.tokens[:100])


@pytest.mark.parametrize("global_batch, micro, dp, expected", [
    (8, 3, 2, r"global_batch_size=8 is not divisible by dp_size \(2\) x training.micro_batch_size \(3\) = 6.*"
              r"Valid micro_batch_size at dp=2: \[2\].*Nearest global_batch_size at dp=2, micro=3: \[6, 12\]"),
    (10, 1, 4, r"dp size 4 does not divide the global batch; dp sizes that do: \[1, 2, 5, 10\]"),
])
def test_impossible_batch_split_names_numbers_and_fixes(global_batch, micro, dp, expected):
    with pytest.raises(ValueError, match=expected):
        make_batch_plan(global_batch, micro, dp)


def test_mixture_config_trains_on_both_sources(pydoc_data, tmp_path):
    from data.prep.writer import prepare_token_file

    (tmp_path / "zzz.txt").write_text("zzz " * 2000)
    prepare_token_file(tmp_path / "zzz", [str(tmp_path / "zzz.txt")], "byte")
    cfg = data_config(mixture={pydoc_data: 0.5, tmp_path / "zzz": 0.5})
    x = torch.cat([m[0] for m in pipeline(cfg, dp=1, rank=0).next_micro_batches(0)])
    is_z = [(row == ord("z")).float().mean() > 0.5 for row in x]
    assert is_z == [False, True] * 4  # 1:1, interleaved


def test_two_epochs_through_the_loaders_visit_every_window_once_each(pydoc_data):
    """What two ranks load over two epochs (steps straddle the boundary: 32 does not divide N)."""
    seq_len = 256
    n = pipeline(data_config(pydoc_data), dp=1, rank=0, seq_len=seq_len).order.sources[0].num_sequences
    assert n % 32
    steps = 2 * n // 32 + 1
    batches = global_batches(data_config(pydoc_data), dp=2, steps=steps, seq_len=seq_len, global_batch=32, micro=16)
    ids = np.concatenate([b[0] for b in batches])
    epoch0, epoch1 = ids[:n], ids[n:2 * n]
    assert sorted(epoch0.tolist()) == list(range(n)) and sorted(epoch1.tolist()) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)
    tokens = TokenFile(pydoc_data).tokens
    inputs = torch.cat([b[1] for b in batches])
    for row in (0, n - 1, n, 2 * n - 1):  # the loaded rows are those windows
        w = int(ids[row])
        assert torch.equal(inputs[row], torch.from_numpy(tokens[w * seq_len: w * seq_len + seq_len].astype(np.int64)))


def test_bad_data_settings_stop_at_start_up(pydoc_data):
    from hydra import compose, initialize_config_dir

    from configs.keys import ConfigError
    from trainer.config import register
    from trainer.preflight import validate_config

    register()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=debug", "data.num_workers=-1", "data.prefetch_factor=0",
                                           f"data.mixture=[{{path: {pydoc_data}, weight: 0}}]"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    for text in ("data.num_workers=-1 must be in [0, 1024]", "data.prefetch_factor=0 must be in [1, 1024]",
                 "data.mixture[0].weight=0.0 must be > 0"):
        assert text in str(err.value)


def test_skipping_samples_after_a_rollback_is_part_of_the_state(pydoc_data, reference):
    """recovery/guards/rollback.py skips the data window that preceded an alarm."""
    states = []
    for rank in range(2):
        pipe = pipeline(data_config(pydoc_data), dp=2, rank=rank)
        for step in range(2):
            pipe.next_micro_batches(step)
        pipe.skip_samples(3 * 8)  # steps 2..4 of the data are never read
        states.append(pipe.state_dict())
    assert states[0] == states[1] and states[0]["step"] == 2 and states[0]["samples_consumed"] == 40
    resumed = global_batches(data_config(pydoc_data), dp=1, steps=3, state=states[0])
    assert_same_batches(resumed, reference[5:8])
    with pytest.raises(ValueError,
                       match=r"skip_samples\(12\): must be a non-negative multiple of the global batch \(8\)"):
        pipe.skip_samples(12)


def test_loader_workers_are_not_forked_from_the_training_process(pydoc_data):
    """Workers start at the first step and again after a rollback or a resume, while the training process
    runs threads (the watchdog, the lease's heartbeat, an async save's writer); a fork copies whatever lock
    one of them holds at that moment into a worker that can then never take it. So the workers come from a
    server process started once, and the batches are the same as loading in the training process."""
    pipe = pipeline(data_config(pydoc_data, num_workers=2), dp=2, rank=0)
    try:
        batches = [pipe.next_micro_batches(step) for step in range(2)]
        workers = [w.pid for w in pipe._batches._workers]  # the multi-process iterator's own list
        parents = [int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) for pid in workers]
        assert len(workers) == 2 and os.getpid() not in parents, (os.getpid(), parents)
    finally:
        pipe.close()
    inline = pipeline(data_config(pydoc_data), dp=2, rank=0)
    for step, micro_batches in enumerate(batches):
        for (x, y), (x_inline, y_inline) in zip(micro_batches, inline.next_micro_batches(step), strict=True):
            assert torch.equal(x, x_inline) and torch.equal(y, y_inline), step
